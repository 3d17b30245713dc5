"""Lesson 14's C++ paged decode kernel and oneDNN-packed linears, against plain torch."""
import pytest
import torch

from minivllm_support import cpu
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward import kernel
from step14_batched_forward.engine import BatchedEngine
from step14_batched_forward.packed_linear import PackedLinear, can_pack, count_modules, pack_linears

needs_kernel = pytest.mark.skipif(kernel.load() is None, reason="paged decode kernel could not be built")


def reference_decode(q, k_pool, v_pool, tables, lens):
    """One sequence at a time: gather its K/V, repeat them for GQA, softmax in float32."""
    B, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    outs = []
    for b in range(B):
        L = int(lens[b])
        k = k_pool[tables[b]].transpose(1, 2).flatten(0, 1)[:L].float().repeat_interleave(Hq // Hkv, 1)
        v = v_pool[tables[b]].transpose(1, 2).flatten(0, 1)[:L].float().repeat_interleave(Hq // Hkv, 1)
        p = (torch.einsum("hd,lhd->hl", q[b].float(), k) * D ** -0.5).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(outs)


def random_case(dtype, Hkv, group, bs, D, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    k_pool = torch.randn(num_blocks, Hkv, bs, D, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, Hkv, bs, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    q = (2 * torch.randn(len(lens), Hkv * group, D, generator=g)).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Hkv, group, bs, D", [(2, 2, 16, 128), (1, 4, 4, 64), (3, 1, 8, 32), (2, 3, 16, 48)])
def test_kernel_equals_reference(dtype, tol, Hkv, group, bs, D):
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3]          # one token, partial, exactly full, spill-over
    q, k_pool, v_pool, tables, lens = random_case(dtype, Hkv, group, bs, D, lens)
    out = kernel.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference_decode(q, k_pool, v_pool, tables, lens), atol=tol, rtol=tol)


@needs_kernel
def test_kernel_ignores_keys_past_the_length():
    q, k_pool, v_pool, tables, lens = random_case(torch.float32, 2, 2, 4, 32, [6, 9])
    out = kernel.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    k2, v2 = k_pool.clone(), v_pool.clone()
    for b, n in enumerate(lens.tolist()):        # scribble over every slot after each sequence's end
        last = tables[b, (n - 1) // 4]
        k2[last, :, n % 4 or 4:], v2[last, :, n % 4 or 4:] = 1e4, 1e4
        k2[tables[b, (n - 1) // 4 + 1:]], v2[tables[b, (n - 1) // 4 + 1:]] = 1e4, 1e4
    torch.testing.assert_close(kernel.paged_decode_attention(q, k2, v2, tables, lens), out)


@needs_kernel
def test_kernel_rejects_bad_input():
    q, k_pool, v_pool, tables, lens = random_case(torch.float32, 2, 2, 4, 32, [3, 7])
    with pytest.raises(TypeError, match="dtype"):
        kernel.paged_decode_attention(q.double(), k_pool, v_pool, tables, lens)
    with pytest.raises(TypeError, match="dtype"):
        kernel.paged_decode_attention(q, k_pool.bfloat16(), v_pool, tables, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        kernel.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor([3, 9]))
    with pytest.raises(ValueError, match="seq_lens"):
        kernel.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="outside the pool"):
        kernel.paged_decode_attention(q, k_pool, v_pool, tables + k_pool.shape[0], lens)
    with pytest.raises(ValueError, match="shapes"):
        kernel.paged_decode_attention(q[:, :3], k_pool, v_pool, tables, lens)
    with pytest.raises(TypeError, match="int64"):
        kernel.paged_decode_attention(q, k_pool, v_pool, tables.int(), lens)


def test_without_a_compiler_the_engine_falls_back(monkeypatch, tmp_path, tiny_qwen3_dir):
    """No C++ compiler: a warning, no kernel, and the torch gather path gives the same tokens."""
    model = load_model(tiny_qwen3_dir, torch.float32)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    ref = [s.output_token_ids for s in BatchedEngine(model, PagedSchedulerConfig(kv_cache_bytes=2**20))
           .generate(prompts, params)]
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    kernel.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no-such-compiler"):
            engine = BatchedEngine(model, PagedSchedulerConfig(kv_cache_bytes=2**20))
        assert not engine.use_kernel
        assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref
    finally:
        kernel.load.cache_clear()


def packing(dtype: torch.dtype):
    """`dtype` as a test parameter, skipped (and saying why) where this CPU packs no such linears."""
    why = "no oneDNN bf16 on this CPU" if dtype == torch.bfloat16 else "float32 is packed on x86 only"
    return pytest.param(dtype, marks=pytest.mark.skipif(not can_pack(dtype), reason=why), id=str(dtype)[6:])


PACKED_DTYPES = [packing(torch.bfloat16), packing(torch.float32)]


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(rows, bias, dtype):
    """bf16: the same oneDNN kernel as F.linear, only the weight copy is saved: equal bits.
    float32: F.linear goes to MKL, the packed weight to oneDNN: equal to float32 rounding."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    with torch.no_grad():
        want = lin(x)
        got = PackedLinear(lin)(x)
        got3 = PackedLinear(lin)(x.view(1, rows, 96))
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got3.shape == (1, rows, 160)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_engine_with_packed_weights_gives_the_same_tokens(tiny_qwen3_dir, dtype):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(40, 70))]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    outs = []
    for pack in (False, True):
        model = load_model(tiny_qwen3_dir, dtype)
        engine = BatchedEngine(model, PagedSchedulerConfig(kv_cache_bytes=2**20), pack_weights=pack)
        assert engine.num_packed == (7 * model.config.num_layers if pack else 0)
        outs.append([s.output_token_ids for s in engine.generate(prompts, params)])
    assert outs[0] == outs[1]


def test_what_is_packed_follows_the_cpu(tiny_qwen3_dir):
    """float32 on x86 (oneDNN beats MKL there, lesson 14's README), nowhere else; bf16 where
    oneDNN computes bf16."""
    assert can_pack(torch.float32) == (cpu.arch() == "x86_64" and torch.backends.mkldnn.is_available())
    assert can_pack(torch.bfloat16) == bool(torch.backends.mkldnn.is_available()
                                            and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not can_pack(torch.float16)
    model = load_model(tiny_qwen3_dir, torch.float32)
    packed = pack_linears(model)
    assert count_modules(packed, PackedLinear) == (7 * model.config.num_layers if can_pack(torch.float32) else 0)
    assert count_modules(model, PackedLinear) == 0          # a transform: the model given is not changed
    if not can_pack(torch.float32):
        assert packed is model
