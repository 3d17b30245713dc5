"""Advanced lesson 14: many LoRA adapters in one batch, held to PEFT's merged model.

Adapters are made here with peft (LoraConfig + get_peft_model, lora_B randomised: PEFT starts
it at zero, which would make every adapter the base model) and saved as PEFT folders; each
adapter's tokens from one mixed batch (several adapters + base requests) must equal HF
`generate` on PEFT's `merge_and_unload()` model for that adapter, in float32.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig

from advanced.adv14_multi_lora.adapters import LoRARequest, load_adapter
from advanced.adv14_multi_lora.engine import build_lora_engine, lora_name
from advanced.adv14_multi_lora.lora_linear import LoRAMapping

# name: (rank, target modules): mixed ranks, overlapping and disjoint targets.
SPECS = {"attn-r4": (4, ["q_proj", "v_proj", "o_proj"]),
         "mlp-r8": (8, ["gate_proj", "up_proj", "down_proj"]),
         "all-r2": (2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [100, 200, 300, 400, 50, 60, 70, 80, 90, 10, 11]]
MAX_TOKENS = 8


def make_adapter(base_dir: Path, out: Path, rank: int, targets: list[str], seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:                     # PEFT's init is zero: the adapter would do nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out)
    return out


def hf_greedy(base_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int):
    """(tokens, first-step logits) per prompt from PEFT's merged model (the base alone if None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            out.append((g.sequences[0, len(p):].tolist(), g.logits[0][0].float()))
    return out


@pytest.fixture(scope="module")
def lora_setup(tiny_qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adv14-adapters")
    requests = [LoRARequest(name, i + 1, str(make_adapter(tiny_qwen3_dir, root / name, r, t, seed=i)))
                for i, (name, (r, t)) in enumerate(SPECS.items())]
    reference = {lr.lora_name if lr else None: hf_greedy(tiny_qwen3_dir, lr and Path(lr.lora_path), PROMPTS, MAX_TOKENS)
                 for lr in [*requests, None]}
    return SimpleNamespace(base=tiny_qwen3_dir, root=root, requests=requests, reference=reference,
                           model=load_model(tiny_qwen3_dir, torch.float32))


def run_mixed(setup, max_loras: int, strategy: str = "auto", max_num_seqs: int = 16):
    """Every prompt with every adapter and with the base, all in one engine run."""
    logits: dict[int, torch.Tensor] = {}

    def keep_first_logits(seqs, rows):
        for s, row in zip(seqs, rows):
            logits.setdefault(s.seq_id, row.clone())
    config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, kv_cache_bytes=2**20,
                                  block_size=4)
    engine = build_lora_engine(setup.model, config, max_loras=max_loras, max_lora_rank=8, lora_strategy=strategy,
                               output_processor=keep_first_logits)
    jobs = [(p, lr) for p in range(len(PROMPTS)) for lr in [*setup.requests, None]]
    seqs = [engine.add_request(PROMPTS[p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               lora_request=lr) for p, lr in jobs]
    most_adapters = 0
    while engine.has_unfinished():
        engine.step()
        running = {lora_name(s) for s in engine.scheduler.running} - {None}
        most_adapters = max(most_adapters, len(running))
    results = {(p, lr.lora_name if lr else None): (s.output_token_ids, logits[s.seq_id]) for (p, lr), s in zip(jobs, seqs)}
    return results, engine, most_adapters


@pytest.mark.parametrize("strategy", ["segments", "stacked"])
def test_mixed_batch_equals_peft_merged_model_per_adapter(lora_setup, strategy):
    results, engine, most = run_mixed(lora_setup, max_loras=4, strategy=strategy)
    assert most == len(SPECS)                        # the adapters really ran side by side
    for (p, name), (tokens, logits) in results.items():
        ref_tokens, ref_logits = lora_setup.reference[name][p]
        assert tokens == ref_tokens, (name, p)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for name in SPECS:                               # and each adapter changes what the model says
        assert any(lora_setup.reference[name][p][0] != lora_setup.reference[None][p][0] for p in range(len(PROMPTS)))
    assert engine.loras.stats().loads == len(SPECS) and engine.loras.stats().evictions == 0


@pytest.mark.parametrize("max_loras", [1, 2])
def test_lru_with_fewer_slots_than_adapters_gives_the_same_tokens(lora_setup, max_loras):
    results, engine, most = run_mixed(lora_setup, max_loras=max_loras)
    for (p, name), (tokens, _) in results.items():
        assert tokens == lora_setup.reference[name][p][0], (name, p)
    stats = engine.loras.stats()
    assert most <= max_loras                          # never more adapters running than slots
    assert len(stats.resident) <= max_loras
    assert stats.loads == stats.evictions + len(stats.resident) and stats.evictions >= len(SPECS) - max_loras


def test_prefix_cache_never_serves_one_adapters_blocks_to_another(lora_setup):
    """The base computes and caches a prompt's blocks; the same prompt under an adapter must
    not reuse them (its K/V differ), while a second base request does."""
    engine = build_lora_engine(lora_setup.model, PagedSchedulerConfig(kv_cache_bytes=2**20, block_size=4),
                               max_loras=2, max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    bm = engine.scheduler.block_manager

    def run(lr):
        hits = bm.hit_tokens
        seq = engine.add_request(PROMPTS[2], sp, lora_request=lr)
        while engine.has_unfinished():
            engine.step()
        return seq.output_token_ids, bm.hit_tokens - hits
    assert run(None) == (lora_setup.reference[None][2][0], 0)
    for lr in lora_setup.requests:
        assert run(lr) == (lora_setup.reference[lr.lora_name][2][0], 0)
    tokens, hits = run(None)
    assert tokens == lora_setup.reference[None][2][0] and hits == 8      # two full blocks of the 11-token prompt


def test_mapping_groups_rows_by_slot():
    slots = torch.tensor([2, 2, -1, 0, 0, 0, 2, -1, 1])
    m = LoRAMapping.build(slots, stacked=True, dtype=torch.float32)
    assert [(s, e - b) for s, b, e in m.segments] == [(0, 3), (1, 1), (2, 3)]
    assert m.order.tolist() == [3, 4, 5, 8, 0, 1, 6]             # sorted by slot, stable within one
    assert m.onehot.shape == (9, 3, 1) and m.onehot[2].sum() == 0 and m.onehot[0, 2, 0] == 1
    assert LoRAMapping.build(torch.tensor([-1, -1]), False, torch.float32) is None


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapter_folders_are_refused_with_the_reason(lora_setup, tmp_path):
    good = Path(lora_setup.requests[0].lora_path)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}

    def check(folder, match, error=ValueError, layers=2, fix=None):
        with pytest.raises(error, match=match):
            load_adapter(LoRARequest("bad", 1, str(folder)), shapes, layers, torch.float32)

    check(tmp_path / "nowhere", "is not a folder", FileNotFoundError)
    no_config = _copy(good, tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    check(no_config, "no adapter_config.json", FileNotFoundError)
    no_weights = _copy(good, tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    check(no_weights, "no adapter_model.safetensors", FileNotFoundError)
    lm_head = _copy(good, tmp_path / "lm-head")
    config = json.loads((lm_head / "adapter_config.json").read_text())
    (lm_head / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    check(lm_head, r"target_modules \['lm_head'\] are not adapted")
    dora = _copy(good, tmp_path / "dora")
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    check(dora, "use_dora=True")
    check(good, "base model has 1 layers", layers=1)            # an adapter of a deeper model
    wide = dict(shapes, q_proj=(96, 96))
    with pytest.raises(ValueError, match=r"layers.0.q_proj: lora_A \(4, 64\).*96 in, 96 out"):
        load_adapter(LoRARequest("bad", 1, str(good)), wide, 2, torch.float32)
    half = _copy(good, tmp_path / "half")
    tensors = load_file(half / "adapter_model.safetensors")
    tensors.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
    save_file(tensors, half / "adapter_model.safetensors")
    check(half, "layers.1.v_proj has lora_A but not its partner")


def test_engine_refuses_unknown_names_rank_and_id_clashes(lora_setup):
    engine = build_lora_engine(lora_setup.model, PagedSchedulerConfig(kv_cache_bytes=2**20), max_loras=2,
                               max_lora_rank=4)
    big = lora_setup.requests[1]                                   # rank 8
    with pytest.raises(ValueError, match="rank 8; this engine's max_lora_rank is 4"):
        engine.add_request([1, 2, 3], lora_request=big)
    engine.loras.register(lora_setup.requests[0])
    with pytest.raises(ValueError, match="already registered"):
        engine.loras.register(LoRARequest("attn-r4", 1, lora_setup.requests[2].lora_path))
    with pytest.raises(ValueError, match="lora_int_id 1 is already used"):
        engine.loras.register(LoRARequest("other", 1, lora_setup.requests[2].lora_path))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")
    assert not engine.has_unfinished()


# ---- the LLM API and the server, on the tiny model with SmolLM2's tokenizer (prompts as ids < 512) ----
@pytest.fixture(scope="module")
def lora_llm(lora_setup, smol_dir, tmp_path_factory):
    from advanced.adv14_multi_lora.llm import LoRALLM

    folder = tmp_path_factory.mktemp("tiny-with-tokenizer")
    for f in Path(lora_setup.base).iterdir():
        shutil.copy(f, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smol_dir) / name, folder)
    with LoRALLM(str(folder), dtype="fp32", max_loras=2, max_lora_rank=8, max_num_seqs=8,
                 kv_cache_bytes=2**20) as llm:
        yield llm


def test_llm_generate_takes_one_lora_request_or_one_per_prompt(lora_setup, lora_llm):
    from advanced.adv14_multi_lora.llm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    attn, mlp, every = lora_setup.requests
    outs = lora_llm.generate(PROMPTS, sp, lora_request=[attn, None, every], use_tqdm=False)
    for p, (out, name) in enumerate(zip(outs, ["attn-r4", None, "all-r2"])):
        assert out.outputs[0].token_ids == lora_setup.reference[name][p][0]
    outs = lora_llm.generate(PROMPTS, sp, lora_request=mlp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in lora_setup.reference["mlp-r8"]]
    with pytest.raises(ValueError, match="got 2 lora_requests for 3 prompts"):
        lora_llm.generate(PROMPTS, sp, lora_request=[attn, None], use_tqdm=False)
    with pytest.raises(FileNotFoundError, match="prompt 0: LoRA adapter 'ghost'"):
        lora_llm.generate(PROMPTS[:1], sp, lora_request=LoRARequest("ghost", 9, "/no/such/folder"), use_tqdm=False)
    assert not lora_llm.engine.has_unfinished()


def test_server_model_field_names_the_adapter(lora_setup, lora_llm):
    from fastapi.testclient import TestClient

    from advanced.adv14_multi_lora.server import replace_models_route, request_classes
    from step20_http_serve.api import build_app
    from step20_http_serve.async_llm import AsyncLLM

    adapters = {lr.lora_name: lr for lr in lora_setup.requests}
    engine = AsyncLLM(lora_llm, "tiny-base")
    completion, chat = request_classes("tiny-base", adapters)
    app = build_app(engine, completion_request=completion, chat_request=chat)
    replace_models_route(app, engine, adapters)
    try:
        with TestClient(app) as client:
            cards = client.get("/v1/models").json()["data"]
            assert [c["id"] for c in cards] == ["tiny-base", *SPECS]
            assert all(c["parent"] == "tiny-base" for c in cards[1:])

            def complete(model, p):
                body = {"model": model, "prompt": PROMPTS[p], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True, "logprobs": 1}
                return client.post("/v1/completions", json=body)
            for p, model in enumerate(["mlp-r8", "tiny-base", "attn-r4"]):
                r = complete(model, p)
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["text"]
                ref = lora_setup.reference[None if model == "tiny-base" else model][p][0]
                assert text == lora_llm.tokenizer.decode(ref, skip_special_tokens=True)
            r = complete("no-such-adapter", 0)
            assert r.status_code == 404 and "`no-such-adapter` does not exist" in r.json()["error"]["message"]
            assert "`mlp-r8`" in r.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_lora_modules_flag_is_name_equals_path():
    from advanced.adv14_multi_lora.server import parse_lora_modules

    assert parse_lora_modules(["sql=/a/sql", "fr=/a/fr"]) == {"sql": "/a/sql", "fr": "/a/fr"}
    with pytest.raises(ValueError, match="'sql' is not name=path"):
        parse_lora_modules(["sql"])
    with pytest.raises(ValueError, match="'sql' is given twice"):
        parse_lora_modules(["sql=/a", "sql=/b"])


# ---- slow: the real checkpoint, and the server built from its flags ------------------------------
@pytest.mark.slow
def test_smollm2_mixed_batch_equals_peft_merged_model(smol_dir, smol_fp32, smol_tokenizer, tmp_path):
    from advanced.adv14_multi_lora.make_adapters import SHAPES, peft_template

    requests = []
    for i, (r, t) in enumerate(SHAPES):
        peft_template(smol_dir, tmp_path / f"r{r}", r, t, i, 0.05)
        requests.append(LoRARequest(f"smol-r{r}", i + 1, str(tmp_path / f"r{r}")))
    prompts = [smol_tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Bees make")]
    engine = build_lora_engine(smol_fp32, PagedSchedulerConfig(max_num_seqs=8, kv_cache_bytes=32 * 2**20),
                               max_loras=2, max_lora_rank=16)
    jobs = [(p, lr) for p in range(len(prompts)) for lr in [*requests, None]]
    seqs = [engine.add_request(prompts[p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora_request=lr)
            for p, lr in jobs]
    while engine.has_unfinished():
        engine.step()
    ours = {(p, lr.lora_name if lr else None): s.output_token_ids for (p, lr), s in zip(jobs, seqs)}
    for lr in [*requests, None]:
        name = lr.lora_name if lr else None
        ref = hf_greedy(smol_dir, lr and Path(lr.lora_path), prompts, 12)
        assert [ours[(p, name)] for p in range(len(prompts))] == [r[0] for r in ref], name
    assert any(ours[(p, requests[1].lora_name)] != ours[(p, None)] for p in range(len(prompts)))


@pytest.mark.slow
def test_build_server_checks_adapters_at_start_and_lists_them(lora_setup, lora_llm, tmp_path):
    from fastapi.testclient import TestClient

    from advanced.adv14_multi_lora.server import build_server

    folder = str(lora_llm.model_dir)
    modules = {"attn": lora_setup.requests[0].lora_path, "mlp": lora_setup.requests[1].lora_path}
    with pytest.raises(FileNotFoundError, match="LoRA adapter 'broken': no adapter_config.json"):
        build_server(folder, lora_modules={**modules, "broken": str(tmp_path)}, dtype="fp32", kv_cache_bytes=2**20)
    app, engine = build_server(folder, lora_modules=modules, served_model_name="base", dtype="fp32", max_loras=1,
                               max_lora_rank=8, kv_cache_bytes=2**20)
    try:
        with TestClient(app) as client:
            assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["base", "attn", "mlp"]
            for model, ref in (("mlp", "mlp-r8"), ("attn", "attn-r4"), ("base", None)):
                body = {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == lora_llm.tokenizer.decode(
                    lora_setup.reference[ref][0][0], skip_special_tokens=True)
        assert engine.llm.lora_stats().loads == 2             # one slot: mlp, then attn evicting it
    finally:
        engine.shutdown()
        engine.llm.close()
