"""Advanced lesson 13: our gated delta rule equals transformers' in both forms, the hybrid model's
logits equal Hugging Face's Qwen3NextForCausalLM, and the engine's greedy tokens equal HF's greedy
choices, unchanged by chunked prefill and by preemption, with every state slot and KV block back
at the end. The GPU-only kernel packages stay out (transformers would take them if importable)."""
from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from advanced.adv13_linear_attention.checkpoint import build_hybrid_checkpoint
from advanced.adv13_linear_attention.config import HybridConfig
from advanced.adv13_linear_attention.engine import HybridEngine, build_hybrid_engine
from advanced.adv13_linear_attention.gated_delta import (conv_decode, conv_prefill, delta_rule_chunked,
                                                         delta_rule_recurrent, prepare)
from advanced.adv13_linear_attention.model import load_hybrid
from advanced.adv13_linear_attention.prefix_state import StateCheckpoints, build_state_prefix_engine
from advanced.adv13_linear_attention.state_pool import StateSlots
from step06_sampler.params import SamplingParams
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig

GPU_ONLY = ("fla", "causal_conv1d", "mamba_ssm")
KV_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4      # tiny model, block_size 4, fp32: attention layers x K/V x heads x dim x slots


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return build_hybrid_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load_hybrid(hybrid_dir, torch.float32)


@pytest.fixture(scope="module")
def hf_hybrid(hybrid_dir):
    from transformers import Qwen3NextForCausalLM
    return Qwen3NextForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32).eval()


def _prompts(lengths=(5, 37, 80, 1, 130), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _config(**kw) -> PagedSchedulerConfig:
    return PagedSchedulerConfig(**{"block_size": 4, "kv_cache_bytes": 512 * KV_BLOCK_BYTES, "max_num_seqs": 4, **kw})


# ---- the recurrences --------------------------------------------------------------------------
def test_gpu_only_kernel_packages_are_absent():
    assert all(importlib.util.find_spec(m) is None for m in GPU_ONLY)


def test_delta_rule_forms_equal_transformers_and_carry_state_across_cuts(one_thread):
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)
    torch.manual_seed(0)
    B, T, Hk, Hv, dk, dv = 2, 150, 2, 4, 16, 8        # 150: three chunks of 64, the last one padded
    q, k, v = torch.randn(B, T, Hk, dk), torch.randn(B, T, Hk, dk), torch.randn(B, T, Hv, dv)
    g, beta, s0 = -2 * torch.rand(B, T, Hv), torch.rand(B, T, Hv), torch.randn(B, Hv, dk, dv)
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    out, state = delta_rule_chunked(*prepare(q, k, v, g, beta), s0)
    rec, rec_state = delta_rule_recurrent(*prepare(q, k, v, g, beta), s0)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec_state, state, atol=1e-5, rtol=1e-5)
    _, hf_rec_state = torch_recurrent_gated_delta_rule(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3],
                                                       initial_state=s0, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(delta_rule_recurrent(*prepare(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3]),
                                                    s0)[1], hf_rec_state, atol=1e-5, rtol=1e-5)
    # A cut anywhere (chunked prefill): 70 tokens, then 80 more from the state they left.
    first, mid = delta_rule_chunked(*prepare(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70]), s0)
    second, end = delta_rule_chunked(*prepare(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:]), mid)
    torch.testing.assert_close(torch.cat([first, second], 2), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, state, atol=1e-5, rtol=1e-5)


def test_conv_state_carries_across_cuts_and_decodes():
    torch.manual_seed(0)
    x, w = torch.randn(10, 6), torch.randn(6, 4)
    whole, whole_state = conv_prefill(x, None, w)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(x.t()[None], w[:, None], padding=3, groups=6)[0, :, :10]).t()
    torch.testing.assert_close(whole, ref)
    a, s = conv_prefill(x[:2], None, w)                 # shorter than the kernel: the state keeps zeros
    b, s = conv_prefill(x[2:7], s, w)
    outs = [a, b]
    for t in range(7, 10):
        o, s3 = conv_decode(x[t:t + 1], s[None], w)
        outs.append(o)
        s = s3[0]
    torch.testing.assert_close(torch.cat(outs), whole)
    torch.testing.assert_close(s, whole_state)


# ---- the model against Hugging Face -------------------------------------------------------------
def test_logits_equal_hf(hybrid, hf_hybrid, one_thread):
    for ids in _prompts((150, 7)):
        ids = torch.tensor(ids)
        ours = hybrid.compute_logits(hybrid(ids, torch.arange(len(ids))))
        torch.testing.assert_close(ours, hf_hybrid(ids[None]).logits[0].float(), atol=1e-5, rtol=1e-4)
    assert not any(m in sys.modules for m in GPU_ONLY)


def test_loader_names_missing_and_unexpected_tensors(hybrid_dir, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(hybrid_dir, folder)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    save_file({**tensors, "model.layers.0.linear_attn.extra": torch.zeros(2)}, str(file), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="linear_attn.extra"):
        load_hybrid(folder, torch.float32)
    save_file({n: t for n, t in tensors.items() if n != "model.layers.1.self_attn.q_norm.weight"}, str(file),
              metadata={"format": "pt"})
    with pytest.raises(KeyError, match="missing.*q_norm"):
        load_hybrid(folder, torch.float32)
    base = HybridConfig.from_pretrained(hybrid_dir)
    assert base.layer_types == ("linear_attention", "full_attention") * 2 and base.rotary_dim == 4
    raw = {"architectures": ["Qwen3NextForCausalLM"], "num_experts": 8, "num_hidden_layers": 4}
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        HybridConfig.from_dict(raw)
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM"):
        HybridConfig.from_dict({"architectures": ["Qwen3ForCausalLM"]})


# ---- the engine -------------------------------------------------------------------------------
def _run(model, config, prompts, max_tokens=12):
    with build_hybrid_engine(model, config, attention_backend="torch") as engine:
        seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        s = engine.scheduler
        assert s.slots.num_free_slots == s.slots.num_slots and not s.slots.slot_of
        assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
        return [q.output_token_ids for q in seqs], s.num_preemptions


def test_engine_tokens_are_hf_greedy_choices(hybrid, hf_hybrid, one_thread):
    """Each generated token is HF's argmax given everything before it (one HF forward per
    request over prompt + output): the engine's greedy run is HF's greedy run."""
    prompts = _prompts()
    outs, _ = _run(hybrid, _config(), prompts)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor(prompt + out)
        choices = hf_hybrid(ids[None]).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        assert choices == out and (len(out) == 12 or out[-1] == 2)


def test_state_survives_chunked_prefill_and_preemption(hybrid, one_thread):
    prompts = _prompts()
    plain, _ = _run(hybrid, _config(), prompts)
    chunked, _ = _run(hybrid, _config(max_num_batched_tokens=24), prompts)   # the 130-token prompt in 6+ pieces
    tight, preemptions = _run(hybrid, _config(max_num_batched_tokens=32, kv_cache_bytes=40 * KV_BLOCK_BYTES), prompts)
    assert chunked == plain and tight == plain
    assert preemptions > 0


def test_slots_and_engine_parts_are_checked(hybrid):
    slots = StateSlots(2)
    a, b, c = (Sequence([1], SamplingParams()) for _ in range(3))
    assert {slots.allocate(a), slots.allocate(b)} == {0, 1} and slots.num_free_slots == 0
    with pytest.raises(RuntimeError, match="out of state slots"):
        slots.allocate(c)
    with pytest.raises(RuntimeError, match="already holds"):
        slots.allocate(a)
    slots.free(a)
    slots.free(a)                                        # freeing twice is harmless: nothing held
    assert slots.allocate(c) == slots.slot_of[c.seq_id] and slots.num_free_slots == 0
    engine = build_hybrid_engine(hybrid, _config(), attention_backend="torch")
    with pytest.raises(ValueError, match="state_pool"):
        HybridEngine(hybrid, engine.scheduler, engine.kv_pool, engine.attention)
    with pytest.raises(TypeError, match="HybridLM"):
        build_hybrid_engine(torch.nn.Linear(2, 2), _config())


def test_state_prefix_cache_resumes_from_checkpoints_with_equal_tokens(hybrid, one_thread):
    """Requests sharing a 37-token prefix (blocks of 4). The first one's checkpoints lie past
    the prefix (its prompt ends at token 57); the second matches 9 blocks of KV but no state, so
    it recomputes them, ending a chunk at token 36 (the junction) where it leaves a checkpoint;
    the last four resume there. Also under preemption; the tokens are the uncached engine's."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (37,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=g).tolist() for n in (20, 9, 1, 3, 12, 6)]
    params = SamplingParams(temperature=0, max_tokens=10)
    ref, _ = _run(hybrid, _config(), prompts, max_tokens=10)
    for config in (_config(), _config(max_num_batched_tokens=32, kv_cache_bytes=20 * KV_BLOCK_BYTES)):
        with build_state_prefix_engine(hybrid, config, checkpoints=8, attention_backend="torch") as engine:
            seqs = [s for group in (prompts[:1], prompts[1:2], prompts[2:]) for s in engine.generate(group, params)]
            assert [s.output_token_ids for s in seqs] == ref
            s, bm = engine.scheduler, engine.scheduler.block_manager
            assert bm.hit_tokens >= 4 * 36 and s.checkpoints.num_restored >= 4
            assert bm.num_free_blocks == bm.num_blocks and s.slots.num_free_slots == s.slots.num_slots
            assert engine.checkpoint_bytes == len(s.checkpoints.slot_of_hash) * engine.state_pool.bytes_per_slot
    assert s.num_preemptions > 0


def test_checkpoints_are_reused_least_recently_used_first():
    ck = StateCheckpoints(2)
    ck.queue_save(11, seq_slot=0)
    ck.queue_save(22, seq_slot=1)
    ck.queue_restore(11, seq_slot=3)                 # 11 used: 22 is now the oldest
    ck.queue_save(33, seq_slot=0)
    assert ck.has(11) and ck.has(33) and not ck.has(22)
    assert ck.take() == ([(0, 0), (1, 1), (0, 1)], [(0, 3)]) and ck.take() == ([], [])
    with pytest.raises(ValueError, match="checkpoint slot"):
        StateCheckpoints(0)


@pytest.mark.slow
def test_greedy_tokens_equal_hf_generate(hybrid, hf_hybrid, one_thread):
    prompts = _prompts((9, 70))
    outs, _ = _run(hybrid, _config(max_num_batched_tokens=16), prompts, max_tokens=10)
    for prompt, out in zip(prompts, outs):
        ref = hf_hybrid.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert out == ref.tolist()
    assert not any(m in sys.modules for m in GPU_ONLY)
