"""Lesson 16's fast path in float32 on x86 (every step where AVX2 is the widest unit, as in
baseline mode; steps of up to 48 rows where there is AVX-512): the linears and the LM head
multiply with gemm_f32 against weights packed in panels (pack_f32: bf16 where the values are
bf16 values, else float32); the float32 numbers of the packed call to the order of the sums,
and the greedy tokens of lesson 15's engine."""
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


def _gemm_f32_build():
    from step14_batched_forward import kernel
    lib = ops.kernels_library()
    if lib is None:
        pytest.skip("elementwise.cpp could not be built (no compiler, or MINIVLLM_KERNEL=0)")
    want = {"avx2": 2**63 - 1, "avx512": 48, "avx512_bf16": 48, "amx": 48}.get(kernel.isa(lib), 0)
    assert ops.gemm_f32_rows() == want, (kernel.isa(lib), ops.gemm_f32_rows())
    if not want:
        pytest.skip(f"gemm_f32 is in x86 builds with AVX2 only; this one is {kernel.isa(lib)!r}")


def _bf16_valued(model):
    """`model` with every parameter rounded to a bf16 value and kept in float32 (what a bf16
    checkpoint loaded as float32 holds)."""
    for p in model.parameters():
        p.data = p.data.bfloat16().float()
    return model


@pytest.mark.parametrize("M", [1, 5, 6, 7, 12, 13, 64])
@pytest.mark.parametrize("N, K", [(960, 576), (37, 96), (3, 1024), (1, 32), (33, 7)])
@pytest.mark.parametrize("bf16_values", [True, False])
def test_gemm_f32_is_the_float32_matmul(M, N, K, bf16_values):
    _gemm_f32_build()
    g = torch.Generator().manual_seed(M * N + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    if bf16_values:
        w = w.bfloat16().float()
    panels = ops.pack_f32(w)
    assert panels.shape == (-(-N // 16), K, 16)
    assert panels.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    want = x.double() @ w.double().t()
    # float32 sums of K products in another order than the reference's: off by ~K ulp at most
    torch.testing.assert_close(ops.gemm_f32(x, panels, N).double(), want, rtol=1e-5, atol=1e-6 * K)
    out = torch.empty(M, N)
    assert ops.gemm_f32(x, panels, N, b, out=out) is out
    torch.testing.assert_close(out.double(), want + b.double(), rtol=1e-5, atol=1e-6 * K)


def test_gemm_f32_names_what_it_was_given():
    _gemm_f32_build()
    panels = ops.pack_f32(torch.randn(20, 64))
    with pytest.raises(ValueError, match="panels"):
        ops.gemm_f32(torch.randn(2, 32), panels, 20)
    with pytest.raises(ValueError, match="out"):
        ops.gemm_f32(torch.randn(2, 64), panels, 20, out=torch.empty(2, 21))


@pytest.mark.slow
def test_float32_linears_run_on_panels(tiny_qwen3_dir):
    """Steps of up to gemm_f32_rows() rows take gemm_f32 (eager and through the op), larger
    ones the packed oneDNN call; small_rows=False leaves the packed call alone."""
    _gemm_f32_build()
    if not can_pack(torch.float32):
        pytest.skip("no oneDNN float32 packing here")
    model = load_model(tiny_qwen3_dir, torch.float32)
    linears = [m for m in cpu_fast_path(model).modules() if type(m) is OpPackedLinear]
    assert linears and all(m.panels is not None and m.panels.dtype == torch.float32 for m in linears)
    assert all(m.panels is None for m in cpu_fast_path(model, small_rows=False).modules() if type(m) is OpPackedLinear)
    lin = next(m for m in cpu_fast_path(_bf16_valued(model)).modules() if type(m) is OpPackedLinear)
    assert lin.panels.dtype == torch.bfloat16
    calls, real = [], ops.kernels_library().gemm_f32
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops.kernels_library(), "gemm_f32", lambda *a: (calls.append(a[1]), real(*a))[1])
        for rows in (1, 5, 64):
            x = torch.randn(rows, lin.in_features)
            want = PackedLinear.forward(lin, x)
            for got in (lin(x), torch.ops.minivllm.packed_linear(x, lin.packed, None, lin.out_features, lin.panels)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [rows for rows in (1, 5, 64) if rows <= ops.gemm_f32_rows() for _ in range(2)], calls


@pytest.mark.slow
@pytest.mark.parametrize("bf16_values", [True, False])
def test_float32_engine_gives_lesson15s_tokens(tiny_qwen3_dir, bf16_values):
    """The whole engine: linears and logits from gemm_f32 (panels of bf16 or of float32),
    greedy tokens as lesson 15's engine gives them on the same model."""
    _gemm_f32_build()
    model = load_model(tiny_qwen3_dir, torch.float32)
    if bf16_values:
        model = _bf16_valued(model)
    bpb = KVPool.bytes_per_block(model.config, 4, torch.float32)
    cfg = PagedSchedulerConfig(block_size=4, kv_cache_bytes=60 * bpb, max_num_seqs=4, max_num_batched_tokens=16)
    engine = build_engine(model, cfg)
    if type(engine.runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here: no fast-path runner")
    head = engine.runner.head_panels
    assert head is not None and head.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3 * j) % (vocab - 2) + 1 for j in range(n)] for i, n in enumerate((3, 40, 17, 9))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [s.output_token_ids for s in build_lesson15(model, cfg).generate(prompts, sp)]
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == want
    assert [s.output_token_ids for s in engine.generate(prompts[:1], sp)] == want[:1]    # a batch of one
