"""Lesson 16's fast path in float32 (an AVX2 CPU, baseline mode): steps of one to four rows
multiply against bf16 copies of weights that hold bf16 values (gemv_f32), the float32 numbers
of the packed call to the order of the sums; weights that are not bf16 values keep no copy."""
import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import PackedLinear, can_pack
from step15_flash_attention.engine import build_engine as build_lesson15
from step16_cuda_graph.cpu import ops
from step16_cuda_graph.cpu.engine import build_engine, cpu_fast_path
from step16_cuda_graph.cpu.ops import OpPackedLinear
from step16_cuda_graph.cpu.runner import CpuGraphRunner


def _gemv_f32_build():
    from step14_batched_forward import kernel
    lib = ops.kernels_library()
    if lib is None:
        pytest.skip("elementwise.cpp could not be built (no compiler, or MINIVLLM_KERNEL=0)")
    x86_avx2 = kernel.isa(lib) in ("avx2", "avx512", "avx512_bf16", "amx")
    assert (ops.gemv_rows(torch.float32) == 4) == x86_avx2, (kernel.isa(lib), ops.gemv_rows(torch.float32))
    if not x86_avx2:
        pytest.skip(f"gemv_f32 is in x86 builds with AVX2 only; this one is {kernel.isa(lib)!r}")
    if not can_pack(torch.float32):
        pytest.skip("no oneDNN float32 packing here")


def _bf16_valued(model):
    """`model` with every parameter rounded to a bf16 value and kept in float32 (what a bf16
    checkpoint loaded as float32 holds)."""
    for p in model.parameters():
        p.data = p.data.bfloat16().float()
    return model


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N, K", [(960, 576), (37, 96), (3, 1024), (1, 32)])
def test_gemv_f32_is_the_float32_matmul(M, N, K):
    _gemv_f32_build()
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
    y = ops.gemv(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    # float32 sums of K products in another order than the reference's: off by ~K ulp at most
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-6 * K)
    out = torch.empty(M, N)
    assert ops.gemv(x, w, out=out) is out and torch.equal(out, y)


@pytest.mark.slow
def test_float32_linears_keep_a_bf16_copy_only_of_bf16_values(tiny_qwen3_dir):
    """Up to 4 rows take gemv_f32 (eager and through the op), more rows oneDNN's packed call;
    a model whose weights are not all bf16 values keeps no copy (it would change the numbers)."""
    _gemv_f32_build()
    model = load_model(tiny_qwen3_dir, torch.float32)
    assert all(m.dense is None for m in cpu_fast_path(model).modules() if type(m) is OpPackedLinear)
    linears = [m for m in cpu_fast_path(_bf16_valued(model)).modules() if type(m) is OpPackedLinear]
    assert linears and all(m.dense is not None and m.dense.dtype == torch.bfloat16 for m in linears)
    lin, calls = linears[0], []
    real = ops.kernels_library().gemv_f32
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops.kernels_library(), "gemv_f32", lambda *a: (calls.append(a[1]), real(*a))[1])
        for rows in (1, 4, 5, 16):
            x = torch.randn(rows, lin.in_features)
            want = PackedLinear.forward(lin, x)
            for got in (lin(x), torch.ops.minivllm.packed_linear(x, lin.packed, None, lin.out_features, lin.dense)):
                assert got.dtype == torch.float32
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1, 1, 4, 4], calls


@pytest.mark.slow
def test_float32_engine_with_bf16_values_gives_lesson15s_tokens(tiny_qwen3_dir):
    """The whole engine: logits of small steps from the head's bf16 copy, linears from gemv_f32,
    greedy tokens as lesson 15's engine gives them on the same model."""
    _gemv_f32_build()
    model = _bf16_valued(load_model(tiny_qwen3_dir, torch.float32))
    bpb = KVPool.bytes_per_block(model.config, 4, torch.float32)
    cfg = PagedSchedulerConfig(block_size=4, kv_cache_bytes=60 * bpb, max_num_seqs=4, max_num_batched_tokens=16)
    engine = build_engine(model, cfg)
    if type(engine.runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here: no fast-path runner")
    assert engine.runner.head_plain is not None and engine.runner.head_plain.dtype == torch.bfloat16
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3 * j) % (vocab - 2) + 1 for j in range(n)] for i, n in enumerate((3, 40, 17, 9))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [s.output_token_ids for s in build_lesson15(model, cfg).generate(prompts, sp)]
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == want
    assert [s.output_token_ids for s in engine.generate(prompts[:1], sp)] == want[:1]    # a batch of one
