"""Advanced lesson 01: RTN quantization stays within half a step of the grid; the int8/int4
linears equal a matmul with their dequantized weights (bit for bit for the weights themselves);
the GGUF file's Q4_1 blocks reach the int4 kernel with exactly the file's values; the quantized
model in lesson 16's engine (either part) and lesson 19's LLM API generates the same greedy tokens as a plain forward
with the dequantized weights; bad input names the problem."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from advanced.adv01_quantization.engine import q4_1_llm, quantize_engine_, quantized_llm, use_model_
from advanced.adv01_quantization.gguf_q4_1 import (GGUF_TO_HF, embedded_gguf, gguf_dequantized, load_q4_1,
                                                   read_q4_1)
from advanced.adv01_quantization.linear import (Int4Linear, Int8Linear, ModuleHeadLM, count_quantized,
                                                quantize_linears, quantize_model, quantized_linear, weight_bytes)
from advanced.adv01_quantization.quality import score
from advanced.adv01_quantization.quantize import W4A16, W8A16, QuantScheme, quantize
from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model
from step05_naive.generate import generate_naive
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import PackedLinear, can_pack, count_modules
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.cpu import engine as fast_path
from step19_real_model.params import SamplingParams as LLMParams

SCHEMES = [W8A16, W4A16, QuantScheme(4, 64, symmetric=True), QuantScheme(4, 128, symmetric=False)]


@pytest.fixture(scope="module")
def plain_smol_fp32(smol_dir):
    """SmolLM2 in fp32 as loaded, for this file alone."""
    return load_model(smol_dir, torch.float32)


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] *= 40                      # an outlier row: its own scale, the others unaffected
    w[5] = 0                        # an all-zero row: scale 0 must not divide by zero
    w[7, :32] = 0.25                # a constant group: max == min
    return w


# ---- the numbers -------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_round_trip_within_half_a_step(scheme):
    w = _weight()
    qw = quantize(w, scheme)
    err = (w - qw.dequantize()).abs()
    if scheme.bits == 8:
        assert qw.q.dtype == torch.int8 and int(qw.q.abs().max()) <= 127
        step = qw.scale[:, None]
    else:
        assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15
        step = qw.scale.repeat_interleave(scheme.group_size, dim=1)
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-7), float((err - step / 2).max())
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))
    if not scheme.symmetric:
        assert torch.equal(qw.dequantize()[7, :32], w[7, :32])
    # the error is a small share of each row's range: 1/254 (int8) or 1/30 of a group's range (int4)
    rel = (err.amax(1) / w.abs().amax(1).clamp_min(1e-12))[w.abs().amax(1) > 0]
    assert float(rel.max()) < (0.0042 if scheme.bits == 8 else 0.15)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_equals_dequantized_matmul(scheme, dtype):
    w, bias = _weight(), torch.randn(96) * 0.1
    qw = quantize(w, scheme)
    want_w = qw.dequantize(dtype).double()             # scale/zero rounded to `dtype`, as the kernel sees them
    mods = [quantized_linear(qw, dtype, bias)]
    if scheme.bits == 8:                               # both paths: the kernel, and convert-then-matmul
        mods += [Int8Linear(qw, dtype, bias, dequant_rows=None), Int8Linear(qw, dtype, bias, dequant_rows=0)]
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 17, 64):
        x = torch.randn(2, rows, 256, generator=g).to(dtype)             # any leading shape
        want = x.double() @ want_w.t() + bias.to(dtype).double()
        for m in mods:
            y = m(x)
            assert y.shape == (2, rows, 96) and y.dtype == dtype
            rel = float((y.double() - want).abs().max() / want.abs().max())
            assert rel < (2e-6 if dtype == torch.float32 else 8e-3), (type(m).__name__, rows, rel)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_kernel_weights_are_the_dequantized_weights_bit_for_bit(scheme):
    """x = identity: each output column is one weight as the kernel computed it (fp32, one FMA)."""
    qw = quantize(_weight(), scheme)
    mods = [quantized_linear(qw, torch.float32)]
    if scheme.bits == 8:
        mods.append(Int8Linear(qw, torch.float32, dequant_rows=None))
    for m in mods:
        assert torch.equal(m(torch.eye(256)).t(), qw.dequantize(torch.float32))
    if scheme.bits == 4:        # torch's kernel itself (Int4Linear widens in float32 instead of calling it)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32), 2)
        sz = torch.stack([qw.scale.t(), qw.zero.t()], dim=-1).contiguous()
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(256), packed, scheme.group_size, sz)
        assert torch.equal(got.t(), qw.dequantize(torch.float32))


def test_int8_scratch_works_in_and_out_of_inference_mode():
    """The converted-weight buffer is shared; one made under inference_mode cannot be written
    outside it, so each mode gets its own."""
    m = quantized_linear(quantize(_weight(), W8A16), torch.bfloat16)
    x = torch.randn(32, 256).to(torch.bfloat16)                        # 32 rows: the convert path
    with torch.inference_mode():
        a = m(x)
    with torch.no_grad():
        b = m(x)
    assert torch.equal(a, b)


def test_weight_bytes_shrink():
    w = _weight(256, 1024)
    bf16 = nn.Linear(1024, 256, bias=False).to(torch.bfloat16)
    int8 = quantized_linear(quantize(w, W8A16), torch.bfloat16)
    int4 = quantized_linear(quantize(w, QuantScheme(4, 128, False)), torch.bfloat16)
    assert weight_bytes(bf16) == 256 * 1024 * 2
    assert weight_bytes(int8) == 256 * 1024 + 256 * 2                     # + one bf16 scale per row
    assert weight_bytes(int4) == 256 * 1024 // 2 + 256 * 8 * 2 * 2       # + bf16 scale and zero per group


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("make, words", [
    (lambda: QuantScheme(3), "bits must be 8 .* or 4"),
    (lambda: QuantScheme(8, group_size=32), "one scale per output row"),
    (lambda: QuantScheme(8, symmetric=False), "one scale per output row"),
    (lambda: QuantScheme(4, group_size=16), "group_size for 4 bits must be one of"),
    (lambda: QuantScheme(4, group_size=None), "group_size for 4 bits"),
    (lambda: quantize(torch.randn(32, 96), QuantScheme(4, 64)), "weight: group_size 64 does not divide in_features 96"),
    (lambda: quantize(torch.randn(24, 64), W4A16, "down"), "down: out_features 24 is not a multiple of 16"),
    (lambda: quantize(torch.randn(64), W8A16), "2-D float weight"),
    (lambda: quantize(torch.ones(4, 4, dtype=torch.int8), W8A16), "2-D float weight"),
    (lambda: quantize_engine_(SimpleNamespace(runner=object()), W8A16), "enforce_eager=True"),
    (lambda: use_model_(SimpleNamespace(runner=object()), None), "use_graph=False"),
    (lambda: quantize_engine_(SimpleNamespace(runner=None, workers=[1]), W8A16), "tensor_parallel_size=1"),
])
def test_bad_input_names_the_problem(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_a_refused_scheme_names_the_layer(tiny_dir):
    model = load_model(tiny_dir, torch.float32)                          # hidden 64: groups of 128 cannot fit
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: group_size 128 does not divide"):
        quantize_linears(model, QuantScheme(4, 128))


def test_quantize_model_is_a_transform(tiny_dir):
    """A new model; the one given keeps its nn.Linears and its head, and shares what did not change."""
    model = load_model(tiny_dir, torch.float32)
    q = quantize_model(model, W4A16, head=W8A16)
    assert count_quantized(q) == 15 and isinstance(q, ModuleHeadLM) and isinstance(q.lm_head, Int8Linear)
    assert count_modules(model, nn.Linear) == 14 and type(model) is not ModuleHeadLM and model.lm_head is None
    assert q.model.embed_tokens is model.model.embed_tokens and q.model.layers[0].input_layernorm is \
        model.model.layers[0].input_layernorm
    assert count_quantized(quantize_linears(model, W8A16)) == 14


# ---- the GGUF file's Q4_1 blocks ---------------------------------------------------------------
@pytest.fixture(scope="module")
def q4_1(smol_dir):
    from step04_transformer.config import ModelConfig
    cfg = ModelConfig.from_pretrained(smol_dir)
    return cfg, *read_q4_1(embedded_gguf(), cfg.num_heads, cfg.num_kv_heads)


def test_gguf_inventory(q4_1):
    _, blocks, report = q4_1
    assert len(blocks) == 210 and report.types["Q8_0 token_embd"] == 1
    assert all(report.types[f"Q4_1 {kind}"] == 30 for kind in GGUF_TO_HF)
    assert sum(n for key, n in report.types.items() if key.startswith("Q4_1")) == 210
    assert sum(b.as_int4()[1] for b in blocks.values()) == 0            # m + 8d exact in float32, every block


@pytest.mark.parametrize("layer, kind", [(0, "attn_q"), (0, "attn_k"), (0, "attn_v"), (0, "attn_output"),
                                         (0, "ffn_gate"), (0, "ffn_up"), (0, "ffn_down"), (29, "attn_k")])
def test_q4_1_repack_is_bit_exact(q4_1, plain_smol_fp32, layer, kind):
    cfg, blocks, _ = q4_1
    name = f"model.layers.{layer}.{GGUF_TO_HF[kind]}"
    b = blocks[name]
    kernel = Int4Linear(b.as_int4()[0], torch.float32)(torch.eye(b.q.shape[1])).t()
    from_gguf = gguf_dequantized(embedded_gguf(), f"blk.{layer}.{kind}.weight", cfg.num_heads, cfg.num_kv_heads)
    assert torch.equal(b.dequantize(), from_gguf)                       # our unpacking = the gguf package's
    assert torch.equal(kernel, from_gguf)                               # = what the int4 kernel multiplies by
    assert torch.equal(kernel, plain_smol_fp32.get_submodule(name).weight)   # = the float copy every lesson loads


def test_quality_scores():
    """Perplexity of a uniform model is the vocabulary size; a model agrees fully with itself."""
    ids = [1, 2, 3, 0, 5]
    uniform = torch.log_softmax(torch.zeros(5, 8), dim=-1)
    q = score(uniform, ids)
    assert abs(q.perplexity - 8) < 1e-4 and q.tokens == 4
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(5, 8, generator=g), dim=-1)
    same, other = score(logp, ids, logp), score(uniform, ids, logp)
    assert same.agreement == 1.0 and abs(same.kl) < 1e-6
    assert other.kl > 0.01


# ---- in the engine and the LLM API -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Larger random weights than conftest's tiny model: greedy text that varies, so a wrong weight
    # shows up as a different token.
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-q"), initializer_range=0.2)


PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]


def _reference_tokens(folder, scheme: QuantScheme | None, head: QuantScheme | None, n: int) -> list[list[int]]:
    """Lesson 05's whole-sequence loop on an fp32 model whose weights are the dequantized ones."""
    model = load_model(folder, torch.float32)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and scheme is not None:
            mod.weight.copy_(quantize(mod.weight, scheme, name).dequantize(torch.float32))
    if head is not None:
        w = quantize(model.model.embed_tokens.weight, head).dequantize(torch.float32)
        model.compute_logits = lambda h: (h @ w.t()).float()
    return [generate_naive(model, p, n, ignore_eos=True).token_ids for p in PROMPTS]


@pytest.mark.parametrize("scheme, head", [(W8A16, None), (W4A16, None), (QuantScheme(4, 64, True), W8A16)],
                         ids=["w8a16", "w4a16-g32-asym", "w4a16-g64-sym+int8-head"])
def test_engine_tokens_equal_dequantized_reference(tiny_dir, scheme, head):
    """The transform before the build (lesson 16's fast-path engine, eager), and an eager engine given its
    model quantized after the build (lesson 16's): both generate the reference's tokens."""
    want = _reference_tokens(tiny_dir, scheme, head, 16)
    config = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_bytes=2**22)
    model = load_model(tiny_dir, torch.float32)
    before = fast_path.build_engine(quantize_model(model, scheme, head), config, use_graph=False)
    after = lesson16.build_engine(model, config, use_graph=False)
    assert quantize_engine_(after, scheme, head) == 14
    for engine in (before, after):
        assert count_quantized(engine.model) == 14 + (head is not None)
        seqs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert [s.output_token_ids for s in seqs] == want
    if scheme.bits == 4:                      # the check can fail: 4 bits change this model's greedy text
        assert want != _reference_tokens(tiny_dir, None, None, 16)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="no oneDNN bf16 on this CPU: no bf16 linear is packed")
def test_quantize_after_packing_equals_quantize_before(tiny_dir):
    """bf16: lesson 16's engine has packed the linears (weights in oneDNN's layout, lesson 14);
    quantizing them then gives the same integers and scales as quantizing the loaded nn.Linear."""
    engine = lesson16.build_engine(load_model(tiny_dir, torch.bfloat16), PagedSchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, kv_cache_bytes=2**22), use_graph=False)
    assert count_modules(engine.model, PackedLinear) == 14
    quantize_engine_(engine, W4A16, head=W8A16)
    fresh = quantize_linears(load_model(tiny_dir, torch.bfloat16), W4A16)
    for (name, a), b in zip(engine.model.model.layers.named_buffers(), fresh.model.layers.buffers()):
        assert torch.equal(a, b), name
    assert isinstance(engine.model.lm_head, Int8Linear) and engine.runner.model is engine.model
    engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))     # and it runs


def test_a_recording_engine_takes_a_model_quantized_before_the_build(tiny_dir):
    """quantize_engine_ refuses lesson 16's graph runner; the transform before the build does not
    need it to: the decode steps are recorded with the quantized linears (lesson 16, eager
    attention kernel calls inside a recorded step on the CPU: compiled)."""
    config = PagedSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, kv_cache_bytes=2**22)
    model = load_model(tiny_dir, torch.float32)
    graph = lesson16.build_engine(model, config, record_now=False)
    with pytest.raises(ValueError, match="use_graph=False"):
        quantize_engine_(graph, W8A16)
    want = _reference_tokens(tiny_dir, W8A16, None, 8)[:2]
    engine = lesson16.build_engine(quantize_model(model, W8A16), config, record_now=False)
    seqs = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [s.output_token_ids for s in seqs] == want and sum(engine.runner.replays.values()) > 0


def test_llm_api_runs_unchanged(tiny_dir):
    want = _reference_tokens(tiny_dir, W4A16, None, 12)
    with quantized_llm(tiny_dir, W4A16, dtype="fp32", kv_cache_bytes=2**22) as llm:
        assert count_quantized(llm.engine.model) > 0 and llm.engine.runner.model is llm.engine.model
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            LLMParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_engine_on_the_files_q4_1_blocks(plain_smol_fp32, smol_tokenizer):
    """fp32, where the int4 kernel's weights are the float copy's exactly: lesson 16's fast-path engine on
    the Q4_1 blocks = lesson 05's loop on the float copy. (torch's int4 kernel has no vectorised
    fp32 path, so the prompt is short.)"""
    ids = smol_tokenizer.encode("The capital of France is")
    want = generate_naive(plain_smol_fp32, ids, 6, ignore_eos=True).token_ids
    model, report = load_q4_1(plain_smol_fp32)
    assert report.swapped == 210 and report.inexact_zeros == 0
    assert count_modules(plain_smol_fp32, nn.Linear) == 210                     # the float copy is unchanged
    engine = fast_path.build_engine(model, PagedSchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=64, kv_cache_bytes=2**24), use_graph=False)
    assert count_modules(engine.model, Int4Linear) == 210
    seq, = engine.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert seq.output_token_ids == want


def test_q4_1_llm(smol_dir):
    llm, report = q4_1_llm(dtype="bf16", kv_cache_bytes=16 * 2**20)
    with llm:
        assert llm.model_dir == smol_dir and report.swapped == 210
        assert count_modules(llm.engine.model, Int4Linear) == 210
        out = llm.generate("The capital of France is", LLMParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


# ---- quality on the embedded model: what run.py's quality section prints -----------------------
@pytest.mark.parametrize("scheme, max_kl, min_agreement", [(W8A16, 0.02, 0.9), (QuantScheme(4, 32, False), 0.02, 0.9)])
def test_quantized_embedded_model_stays_close_on_the_lessons_text(smol_dir, smol_tokenizer, scheme, max_kl,
                                                                   min_agreement):
    """The embedded SmolLM2 in bf16, quantized, scored on quality.TEXT against itself unquantized:
    perplexity within 3%, mean KL and top-1 agreement within bounds (the README's run: W8A16
    0.0045 nats and 95.5%, W4A16 g32 asym 0.0015 and 96.6%); and the measure can tell a bad
    scheme (g32 symmetric: 0.36 nats there) from a good one."""
    from advanced.adv01_quantization.linear import quantize_model
    from advanced.adv01_quantization.quality import TEXT, log_probs
    from step04_transformer.loader import load_model
    base = load_model(smol_dir, torch.bfloat16)
    ids = smol_tokenizer.encode(TEXT)
    ref = log_probs(base, ids)
    plain = score(ref, ids)
    good = score(log_probs(quantize_model(base, scheme), ids), ids, ref)
    assert abs(good.perplexity / plain.perplexity - 1) < 0.03, (good, plain)
    assert good.kl < max_kl and good.agreement > min_agreement, good
    bad = score(log_probs(quantize_model(base, QuantScheme(4, 32, True)), ids), ids, ref)
    assert bad.kl > 10 * good.kl and bad.agreement < good.agreement, (bad, good)
