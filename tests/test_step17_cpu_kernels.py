"""Lesson 16's bf16 fast paths, each against what it replaces: the attention op's prompt chunks
(SDPA or AMX tiles), fused q|k|v and gate|up projections, elementwise.cpp's passes, the C
argmax, and the embedded SmolLM2 through all of them against lesson 14's eager engine."""
from __future__ import annotations

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention import flash_cpu
from step16_cuda_graph import engine as engine_module
from step16_cuda_graph.engine import GraphEngine
from tests.test_step16_cuda_graph import _prompts

needs_kernel = pytest.mark.skipif(flash_cpu.load() is None, reason="no C++ compiler for the kernel")


@pytest.mark.skipif(flash_cpu.load() is None, reason="no C++ compiler: lesson 15's kernel is unavailable")
@pytest.mark.parametrize("path", ["sdpa", "amx"])
@pytest.mark.parametrize("Hq, Hkv, D, bs, n_q, lens", [
    (4, 2, 64, 16, [5, 1, 24, 1], [30, 17, 24, 40]),          # later chunk, decode, fresh prompt, decode
    (6, 2, 128, 4, [37, 1, 70, 2], [101, 9, 70, 33]),          # 3 heads a group, tiny blocks, many tiles
])
def test_bf16_prompt_chunks_match_the_kernel(monkeypatch, path, Hq, Hkv, D, bs, n_q, lens):
    """A bf16 step mixing fresh prompts, later chunks of prompts and decodes: the op (prompt
    chunks through SDPA or the AMX kernel, decodes through a sub-batch of lesson 15's kernel)
    gives lesson 15's kernel's result on the whole batch, to bf16 rounding; decodes exactly."""
    from step16_cuda_graph import ops
    if path == "amx" and ops.amx_library() is None:
        pytest.skip("no AMX tiles on this CPU (or no compiler)")
    if path == "sdpa":
        monkeypatch.setattr(ops, "amx_prefill_fits", lambda q, k_cache: False)
    g = torch.Generator().manual_seed(0)
    width = max(-(-L // bs) for L in lens)
    pool_blocks = sum(-(-n // bs) for n in lens) + 1
    k_cache = torch.randn(pool_blocks, Hkv, bs, D, generator=g).bfloat16()
    v_cache = torch.randn(pool_blocks, Hkv, bs, D, generator=g).bfloat16()
    perm = torch.randperm(pool_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    rows = []
    for b, (n, L) in enumerate(zip(n_q, lens)):
        for j in range(-(-L // bs)):
            tables[b, j] = perm.pop()
        for pos in range(L - n, L):                   # where this step's K/V rows land (head-major)
            rows.append([(tables[b, pos // bs] * Hkv + h) * bs + pos % bs for h in range(Hkv)])
    T = sum(n_q)
    q = torch.randn(T, Hq, D, generator=g).bfloat16()
    k = torch.randn(T, Hkv, D, generator=g).bfloat16()
    v = torch.randn(T, Hkv, D, generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()])
    rows = torch.tensor(rows).flatten()
    kc, vc = k_cache.clone(), v_cache.clone()
    out = ops.paged_attention(q, k, v, kc, vc, rows, cu, torch.tensor(lens), tables)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k.view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
    ref_v.view(-1, D).index_copy_(0, rows, v.reshape(-1, D))
    ref = flash_cpu.flash_attention_cpu(q, ref_k, ref_v, cu, torch.tensor(lens), tables)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for b, n in enumerate(n_q):
        if n == 1:                                    # the decodes: same kernel, same bits
            assert torch.equal(out[cu[b]], ref[cu[b]])


def test_fused_projections_give_the_same_numbers(tiny_qwen3_dir):
    """bf16, packed as lesson 14 packs: q|k|v and gate|up as one matmul each change no bit of the
    forward pass; float32 (not packed) and a model fused already are left alone."""
    from step14_batched_forward.packed_linear import can_pack, pack_linears
    from step16_cuda_graph.fused import FusedQKVAttention, FusedSwiGLU, fuse_projections
    if not can_pack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing on this CPU")
    plain, fused = (load_model(tiny_qwen3_dir, torch.bfloat16) for _ in range(2))
    pack_linears(plain), pack_linears(fused)
    layers = plain.config.num_layers
    assert fuse_projections(fused) == 2 * layers and fuse_projections(fused) == 0
    assert all(type(layer.self_attn) is FusedQKVAttention and type(layer.mlp) is FusedSwiGLU
               for layer in fused.model.layers)
    ids = torch.tensor(_prompts(plain, (37,))[0])
    with torch.inference_mode():
        assert torch.equal(plain(ids, torch.arange(37)), fused(ids, torch.arange(37)))
    assert fuse_projections(load_model(tiny_qwen3_dir, torch.float32)) == 0


@needs_kernel
def test_bf16_engine_fuses_and_gives_the_tokens_of_the_unfused_one(monkeypatch, tiny_qwen3_dir):
    from step14_batched_forward.packed_linear import can_pack
    if not can_pack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing on this CPU")
    model = load_model(tiny_qwen3_dir, torch.bfloat16)
    prompts = _prompts(model, (3, 40, 17, 9))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cfg = PagedSchedulerConfig(block_size=4, kv_cache_bytes=60 * KVPool.bytes_per_block(model.config, 4, torch.bfloat16),
                               max_num_seqs=4, max_num_batched_tokens=16)
    with monkeypatch.context() as m:
        m.setattr(engine_module, "fuse_projections", lambda model, kernels=False: 0)
        unfused = GraphEngine(load_model(tiny_qwen3_dir, torch.bfloat16), cfg)
        ref = [s.output_token_ids for s in unfused.generate(prompts, sp)]
    engine = GraphEngine(model, cfg)
    assert unfused.num_fused == 0 and engine.num_fused == 2 * model.config.num_layers
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref


def test_elementwise_kernels_round_as_lesson04_does():
    """elementwise.cpp: q/k RMSNorm + RoPE (with and without Qwen3's q/k norms) and SwiGLU's
    silu(gate) * up, against lesson 04's bf16 code: the same bf16 values but for float32 sum
    order (so at most one bf16 step apart, and almost all equal)."""
    from step03_attention.attention import apply_rope
    from step04_transformer.layers import RMSNorm, RotaryEmbedding
    from step16_cuda_graph import ops
    if ops.elementwise_library() is None:
        pytest.skip("elementwise.cpp could not be built (no compiler, or MINIVLLM_KERNEL=0)")
    g = torch.Generator().manual_seed(0)
    T, nh, nkv, D, inner = 37, 4, 2, 64, 96
    qkv = torch.randn(T, (nh + 2 * nkv) * D, generator=g).bfloat16()
    q_norm, k_norm = RMSNorm(D, 1e-6).bfloat16(), RMSNorm(D, 1e-6).bfloat16()
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        k_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
    cos, sin = RotaryEmbedding(D, 1e6, 512)(torch.arange(300, 300 + T))

    def close(got, want):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
        assert (got == want).float().mean() > 0.99

    with torch.no_grad():
        q_heads, k_heads = qkv[:, :nh * D].view(T, nh, D), qkv[:, nh * D:(nh + nkv) * D].view(T, nkv, D)
        q, k = ops.qk_norm_rope(qkv, q_norm.weight, k_norm.weight, cos, sin, nh, nkv, 1e-6)
        close(q, apply_rope(q_norm(q_heads), cos, sin))
        close(k, apply_rope(k_norm(k_heads), cos, sin))
        q, k = ops.qk_norm_rope(qkv, None, None, cos, sin, nh, nkv, 0.0)     # a model without q/k norms
        close(q, apply_rope(q_heads, cos, sin))
        close(k, apply_rope(k_heads, cos, sin))
        gate_up = (3 * torch.randn(T, 2 * inner, generator=g)).bfloat16()
        close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:])


@needs_kernel
def test_bf16_smollm2_through_the_fast_paths_says_what_eager_says(smol_dir, smol_tokenizer):
    """The embedded SmolLM2 in bf16 (head_dim 64, 3 query heads a KV head): fused projections,
    elementwise.cpp and the AMX prompt kernel where this CPU has them, prompts split in chunks.
    bf16 paths round differently, so only text the model is sure of is compared with lesson 14's
    eager bf16 engine."""
    from step16_cuda_graph import ops
    prompts = [smol_tokenizer.encode(t) for t in ("The capital of France is",
                                                  "One, two, three, four, five, six, seven, eight,")]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def config(model):
        return PagedSchedulerConfig(kv_cache_bytes=64 * KVPool.bytes_per_block(model.config, 16, torch.bfloat16),
                                    max_num_seqs=2, max_num_batched_tokens=8)
    eager = load_model(smol_dir, torch.bfloat16)
    want = [s.output_token_ids for s in BatchedEngine(eager, config(eager)).generate(prompts, sp)]
    model = load_model(smol_dir, torch.bfloat16)
    engine = GraphEngine(model, config(model))
    if engine.runner is None:
        pytest.skip("torch.compile does not work here")
    assert engine.num_fused == (2 * model.config.num_layers if engine.num_packed else 0)
    kernels = ops.elementwise_library() is not None and engine.num_fused > 0
    assert all(getattr(layer.mlp, "kernels", False) == kernels for layer in model.model.layers)
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == want


def test_row_argmax_picks_what_torch_picks():
    """ops.row_argmax (one C pass, AVX-512 where the CPU has it): the first of equal maxima, the
    first NaN of a row that has one, all -inf rows, row lengths around the 16-lane width,
    strided rows; and the engine's sampler uses it."""
    from step16_cuda_graph import ops
    from step16_cuda_graph.engine import KernelSampler
    g = torch.Generator().manual_seed(0)
    for B, V in [(1, 7), (3, 31), (2, 32), (5, 33), (4, 1000), (2, 5003)]:
        cases = [torch.randn(B, V, generator=g), torch.randint(0, 3, (B, V), generator=g).float(),
                 torch.full((B, V), float("-inf"))]
        with_nan = torch.randint(0, 3, (B, V), generator=g).float()
        with_nan[:, V // 2] = float("nan")
        with_nan[0, V - 1] = float("nan")
        cases += [with_nan, torch.randn(B, 2 * V, generator=g)[:, :V]]
        for x in cases:
            assert torch.equal(ops.row_argmax(x), x.max(dim=-1).indices), (B, V)
    logits = torch.randn(3, 50, generator=g)
    params = [SamplingParams(temperature=0)] * 3
    assert torch.equal(KernelSampler()(logits, params), logits.argmax(dim=-1))
