"""Lesson 15: the torch tiled algorithm and the C++ paged flash kernel against float32
attention; the engine against lesson 05; the backend choice."""
import dataclasses

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention import backends, flash_cpu
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import build_engine
from step15_flash_attention.flash_cpu import flash_attention_cpu
from step15_flash_attention.flash_torch import flash_attention_torch
from step15_flash_attention.reference import random_paged_case, reference_attention

needs_kernel = pytest.mark.skipif(flash_cpu.load() is None, reason="flash attention kernel could not be built")


def _cpu(*case):
    return flash_attention_cpu(*case)


def _torch(*case):
    return flash_attention_torch(*case, q_tile=8, kv_tile_blocks=2)   # small tiles: many tiles, many rescales


KERNELS = [pytest.param(_torch, id="torch"), pytest.param(_cpu, id="cpu", marks=needs_kernel)]


def _cases(bs):
    """(q_lens, seq_lens): decodes, whole prompts, chunks with prior context, partial and full blocks."""
    return [
        ([1, 1, 1], [1, bs, 5 * bs + 3]),                              # decodes only, length 1 to many blocks
        ([3 * bs + 1], [3 * bs + 1]),                                  # one whole prompt
        ([1, 2 * bs, 5, 1, 3 * bs + 2], [9, 2 * bs, bs + 5, 4 * bs, 7 * bs + 1]),  # mixed, prior context
        ([bs - 1, 70], [bs - 1, 150]),                                 # partial block; long chunk, long context
    ]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Hkv, group, bs, D", [(2, 2, 16, 128), (1, 4, 4, 64), (2, 1, 32, 64), (3, 3, 8, 128),
                                               (1, 2, 5, 48), (1, 2, 8, 40)])  # 40: columns past D / 16 * 16
def test_equals_reference(kernel, dtype, tol, Hkv, group, bs, D):
    for i, (q_lens, seq_lens) in enumerate(_cases(bs)):
        case = random_paged_case(q_lens, seq_lens, Hkv, group, bs, D, dtype, seed=i)
        out = kernel(*case)
        assert out.dtype == dtype and out.shape == case[0].shape
        torch.testing.assert_close(out.float(), reference_attention(*case), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_past_the_length_are_never_read(kernel, dtype):
    bs = 4
    case = random_paged_case([1, 6, 3], [6, 9, 11], 2, 2, bs, 64, dtype, spare_blocks=4)
    q, k_pool, v_pool, cu, lens, tables = case
    out = kernel(*case)
    k2, v2 = k_pool.clone(), v_pool.clone()
    used = set()
    for b, n in enumerate(lens.tolist()):
        last = int(tables[b, (n - 1) // bs])
        k2[last, :, (n - 1) % bs + 1:] = float("nan")              # the rest of the last block
        v2[last, :, (n - 1) % bs + 1:] = float("nan")
        used.update(tables[b, :(n - 1) // bs + 1].tolist())
    for blk in set(range(k_pool.shape[0])) - used:                 # blocks no sequence owns
        k2[blk], v2[blk] = float("nan"), float("nan")
    torch.testing.assert_close(kernel(q, k2, v2, cu, lens, tables), out)


@needs_kernel
def test_kernel_uses_the_threads_it_is_given():
    case = random_paged_case([40, 1, 33], [100, 50, 33], 2, 2, 16, 128, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flash_attention_cpu(*case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, flash_attention_cpu(*case))      # work items do not depend on the thread count


@needs_kernel
def test_kernel_rejects_bad_input():
    """Each bad input is refused by the check that names it (error type and message), before
    any pointer reaches C++."""
    q, k_pool, v_pool, cu, lens, tables = random_paged_case([3, 1], [5, 9], 2, 2, 4, 32)
    bad = {   # what is wrong: (the change, the error it must raise, words its message must hold)
        "dtype": (dict(k_pool=k_pool.bfloat16()), TypeError, "must share one dtype"),
        "head_dim": (dict(q=q[..., :16]), ValueError, "shapes do not fit"),
        "heads": (dict(q=q[:, :3]), ValueError, "shapes do not fit"),
        "int64": (dict(seq_lens=lens.int()), TypeError, "seq_lens must be int64"),
        "block id": (dict(block_tables=tables.clone().fill_(10_000)), ValueError, "ids outside the pool"),
        "negative block": (dict(block_tables=tables.clone().fill_(-1)), ValueError, "ids outside the pool"),
        "capacity": (dict(seq_lens=torch.tensor([5, 99])), ValueError, "the block tables' capacity"),
        "more queries than keys": (dict(seq_lens=torch.tensor([2, 9])), ValueError, "more queries than keys"),
        "cu_seqlens_q": (dict(cu_seqlens_q=torch.tensor([0, 3, 5])), ValueError, "must rise from 0 to T=4"),
        "batch": (dict(block_tables=tables[:1]), ValueError, "do not describe one batch"),
    }
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, cu_seqlens_q=cu, seq_lens=lens, block_tables=tables)
    for what, (change, error, words) in bad.items():
        with pytest.raises(error) as err:
            flash_attention_cpu(**{**args, **change})
        assert words in str(err.value), f"{what}: {err.value}"


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_kernel), "torch"])
def test_engine_equals_naive_with_chunks_and_prefix_hits(smol_fp32, engine_workload, backend):
    prompts, params, ref = engine_workload
    bpb = KVPool.bytes_per_block(smol_fp32.config, 16, torch.float32)
    engine = build_engine(smol_fp32, PagedSchedulerConfig(kv_cache_bytes=400 * bpb, max_num_seqs=6,
                                                           max_num_batched_tokens=24), attention_backend=backend)
    assert engine.attention.name == backend
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # chunked prefill
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # prefix-cache hits
    st = engine.stats()
    assert st.prefix_cache_hits > 0 and st.kv_blocks_used == 0


@needs_kernel
def test_engine_equals_lesson14_under_preemption(tiny_qwen3_dir):
    model = load_model(tiny_qwen3_dir, torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, model.config.vocab_size, (int(n),), generator=g).tolist() for n in (3, 40, 17, 64, 9)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = PagedSchedulerConfig(block_size=4, kv_cache_bytes=30 * KVPool.bytes_per_block(model.config, 4, torch.float32),
                                  max_num_seqs=4, max_num_batched_tokens=16)
    ref = [s.output_token_ids for s in BatchedEngine(model, config, pack_weights=False).generate(prompts, sp)]
    engine = build_engine(model, config, attention_backend="cpu")
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert engine.scheduler.num_preemptions > 0


def test_backend_choice(monkeypatch):
    auto = choose_backend("auto", "cpu")
    assert auto.name == ("cpu" if flash_cpu.load() is not None else "torch")
    assert choose_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention_backend"):
        choose_backend("xformers")
    with pytest.raises(ValueError, match="cannot run on cpu"):
        choose_backend("flash-attn", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        choose_backend("triton", "cpu")


def test_block_size_follows_the_backend(monkeypatch, tiny_qwen3_dir):
    """A backend whose kernel needs blocks of 256 tokens (flash-attn 2) gets them."""
    torch_backend, ok = backends.BACKENDS["torch"]
    picky = dataclasses.replace(torch_backend, name="picky", block_size_multiple=256)
    monkeypatch.setitem(backends.BACKENDS, "picky", (picky, ok))
    model = load_model(tiny_qwen3_dir, torch.float32)
    config = PagedSchedulerConfig(kv_cache_bytes=8 * 2**20)          # asks for blocks of 16
    engine = build_engine(model, config, attention_backend="picky")
    assert engine.attention is picky
    assert engine.kv_pool.block_size == 256 and engine.scheduler.block_manager.block_size == 256
    assert engine.kv_pool.num_blocks == 8 * 2**20 // KVPool.bytes_per_block(model.config, 256, torch.float32)
    prompts = [[5, 6, 7], list(range(20, 300))]                         # the second spans two blocks of 256
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = build_engine(model, config, attention_backend="torch")        # the same kernel on blocks of 16
    assert ref.kv_pool.block_size == 16
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == \
        [s.output_token_ids for s in ref.generate(prompts, sp)]


def test_without_a_compiler_auto_falls_back_to_torch(monkeypatch, tmp_path):
    from step14_batched_forward import kernel as lesson14_kernel
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    flash_cpu.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="flash attention kernel unavailable"):
            assert choose_backend("auto", "cpu").name == "torch"
        with pytest.raises(ValueError, match="cannot run"):
            choose_backend("cpu", "cpu")
    finally:
        flash_cpu.load.cache_clear()
    assert lesson14_kernel.SOURCE.is_file()


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("bs, D", [(16, 128), (64, 64), (8, 128)])
def test_float32_decodes_over_long_contexts(group, bs, D):
    """Decode rows only, contexts of many blocks (and of many 16-key chunks per block): the fused
    float32 decode items of AVX2 builds (decode_f32.h; other builds run the generic loops)."""
    lens = [1, 15, 17, 16 * 9 + 5, 1000]
    case = random_paged_case([1] * len(lens), lens, 2, group, bs, D, torch.float32, seed=group)
    torch.testing.assert_close(flash_attention_cpu(*case), reference_attention(*case), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("Hkv, B", [(8, 3), (8, 64), (3, 6), (2, 1)])
def test_float32_decodes_of_several_heads_an_item(Hkv, B):
    """Many decodes in one step: a float32 decode item takes several KV heads of a sequence,
    block after block. How many depends on the threads (decode_f32_heads): with 2, 8 heads over
    3 sequences go 3 + 3 + 2 and 3 heads over 6 go 2 + 1 (a last group of fewer heads); 8 over
    64 sequences go all 8 together with up to 16 threads; one sequence alone keeps one head an
    item."""
    lens = [1 + (37 * i) % 300 for i in range(B)]
    case = random_paged_case([1] * B, lens, Hkv, 2, 16, 128, torch.float32, seed=B)
    torch.testing.assert_close(flash_attention_cpu(*case), reference_attention(*case), atol=1e-5, rtol=1e-5)
