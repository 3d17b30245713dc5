"""Lesson 16's fast-path C passes against what they replace: elementwise.cpp's q/k norm + RoPE and
silu(gate) * up against lesson 04's bf16 code, and the C argmax against torch's."""
from __future__ import annotations

import pytest
import torch

from step06_sampler.params import SamplingParams


def test_elementwise_kernels_round_as_lesson04_does():
    """elementwise.cpp: q/k RMSNorm + RoPE (with and without Qwen3's q/k norms) and SwiGLU's
    silu(gate) * up, against lesson 04's bf16 code: the same bf16 values but for float32 sum
    order (so at most one bf16 step apart, and almost all equal)."""
    from step03_attention.attention import apply_rope
    from step04_transformer.layers import RMSNorm, RotaryEmbedding
    from step16_cuda_graph.cpu import ops
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


def test_row_argmax_picks_what_torch_picks(monkeypatch):
    """ops.row_argmax (one C pass of elementwise.cpp, AVX-512 where the CPU has it): the first
    of equal maxima, the first NaN of a row that has one, all -inf rows, row lengths around the
    16-lane width, strided rows; and the engine's sampler uses it. Every call is counted at the
    library's row_argmax_f32, so a row_argmax that fell back to torch (torch compared with
    torch) fails here instead of passing."""
    from step16_cuda_graph.cpu import ops
    from step16_cuda_graph.cpu.engine import KernelSampler
    lib = ops.kernels_library()
    if lib is None:
        pytest.skip("elementwise.cpp (ops.kernels_library, home of row_argmax_f32) could not be built: "
                    "no C++ compiler, or MINIVLLM_KERNEL=0")
    assert hasattr(lib, "row_argmax_f32"), "elementwise.cpp's library does not export row_argmax_f32"
    c_pass, calls = lib.row_argmax_f32, []

    def counted(*args):
        calls.append(args[1:4])                          # rows, row length, row stride
        return c_pass(*args)
    monkeypatch.setattr(lib, "row_argmax_f32", counted)
    g = torch.Generator().manual_seed(0)
    for B, V in [(1, 7), (3, 31), (2, 32), (5, 33), (4, 1000), (2, 5003)]:
        cases = [torch.randn(B, V, generator=g), torch.randint(0, 3, (B, V), generator=g).float(),
                 torch.full((B, V), float("-inf"))]
        with_nan = torch.randint(0, 3, (B, V), generator=g).float()
        with_nan[:, V // 2] = float("nan")
        with_nan[0, V - 1] = float("nan")
        cases += [with_nan, torch.randn(B, 2 * V, generator=g)[:, :V]]
        for x in cases:
            before = len(calls)
            got = ops.row_argmax(x)
            assert calls[before:] == [(B, V, x.stride(0))], \
                f"row_argmax of a float32 [{B}, {V}] (row stride {x.stride(0)}) did not run the C pass"
            assert torch.equal(got, x.max(dim=-1).indices), f"row_argmax_f32 disagrees with torch on [{B}, {V}]"
    logits = torch.randn(3, 50, generator=g)
    params = [SamplingParams(temperature=0)] * 3
    before = len(calls)
    assert torch.equal(KernelSampler()(logits, params), logits.argmax(dim=-1))
    assert calls[before:] == [(3, 50, 50)], "KernelSampler's greedy pick did not go through row_argmax_f32"


def _gemv_build():
    """The library and whether its build has gemv_bf16 (its AVX-512 BF16 build must)."""
    from step14_batched_forward import kernel
    from step16_cuda_graph.cpu import ops
    lib = ops.kernels_library()
    if lib is None:
        pytest.skip("elementwise.cpp could not be built (no compiler, or MINIVLLM_KERNEL=0)")
    bf16_build = kernel.isa(lib) in ("avx512_bf16", "amx")
    assert (ops.gemv_max_rows() == 4) == bf16_build, (kernel.isa(lib), ops.gemv_max_rows())
    if not bf16_build:
        pytest.skip(f"gemv_bf16 is in the AVX-512 BF16 build only; this one is {kernel.isa(lib)!r}")
    return ops


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N, K", [(960, 576), (37, 96), (3, 1024), (1, 32)])
def test_gemv_is_the_matmul_to_bf16_rounding(M, N, K):
    """gemv_bf16 (a linear of one to four rows on the plain weight) against a float32 matmul of
    the same bf16 numbers: each output is that sum rounded to bf16, the sum's order aside."""
    ops = _gemv_build()
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    y = ops.gemv(x, w)
    want = x.float() @ w.float().t()
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    torch.testing.assert_close(y.float(), want, rtol=2 ** -8, atol=1e-3 * K ** 0.5)


def test_small_steps_take_the_gemv_and_larger_ones_onednn(tiny_qwen3_dir):
    """The fast path's bf16 linears keep a plain copy of their weight; a step of up to 4 rows
    goes to gemv_bf16 (eager and through the op), more rows to oneDNN's packed call, both giving
    the linear's numbers; small_rows=False keeps no copy."""
    ops = _gemv_build()
    from step04_transformer.loader import load_model
    from step14_batched_forward.packed_linear import PackedLinear
    from step16_cuda_graph.cpu.engine import cpu_fast_path
    from step16_cuda_graph.cpu.ops import OpPackedLinear
    model = load_model(tiny_qwen3_dir, torch.bfloat16)
    fast = cpu_fast_path(model)
    linears = [m for m in fast.modules() if type(m) is OpPackedLinear]
    assert linears and all(m.dense is not None for m in linears)
    assert all(m.dense is None for m in cpu_fast_path(model, small_rows=False).modules() if type(m) is OpPackedLinear)
    lin = linears[0]
    calls = []
    real = ops.kernels_library().gemv_bf16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops.kernels_library(), "gemv_bf16", lambda *a: (calls.append(a[1]), real(*a))[1])
        for rows in (1, 4, 5, 16):
            x = torch.randn(rows, lin.in_features).bfloat16()
            want = PackedLinear.forward(lin, x)                 # oneDNN's packed call
            for got in (lin(x), torch.ops.minivllm.packed_linear(x, lin.packed, None, lin.out_features, lin.dense)):
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
    assert calls == [1, 1, 4, 4], calls                        # 5 and 16 rows: never the GEMV


def test_small_steps_take_their_logits_from_the_gemv_too(tiny_qwen3_dir):
    """The fast-path runner computes the logits of up to 4 rows with gemv_bf16 on the head's own
    plain weight (the embedding, tied, or its copy on 2 MB pages), the packed head's numbers to bf16
    rounding; more rows, and small_rows=False, go through the packed head."""
    ops = _gemv_build()
    from step04_transformer.loader import load_model
    from step12_paged_attention.scheduler import PagedSchedulerConfig
    from step16_cuda_graph.cpu.engine import build_engine
    from step16_cuda_graph.cpu.runner import CpuGraphRunner
    model = load_model(tiny_qwen3_dir, torch.bfloat16)
    config = PagedSchedulerConfig(max_num_seqs=8, kv_cache_bytes=1 << 20)
    runner = build_engine(model, config, record_now=False).runner
    if type(runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here: no fast-path runner")
    assert runner.head_plain is not None
    assert torch.equal(runner.head_plain, model.model.embed_tokens.weight)    # the embedding, or its copy
    assert build_engine(model, config, record_now=False, small_rows=False).runner.head_plain is None
    calls = []
    real = ops.kernels_library().gemv_bf16_f32        # into the float32 logits buffer, no copy
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops.kernels_library(), "gemv_bf16_f32", lambda *a: (calls.append(a[1]), real(*a))[1])
        for rows in (1, 4, 6):
            h = torch.randn(rows, model.config.hidden_size).bfloat16()
            got = runner.compute_logits(h)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, runner.lm_head(h).float(), rtol=2 ** -7, atol=1e-2)
    assert calls == [1, 4], calls
