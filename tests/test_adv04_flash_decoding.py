"""Advanced lesson 04: flash-decoding (split-KV) equals lesson 15's float32 reference attention for
the torch version, the C++ kernel and the Triton kernels (in Triton's interpreter); the merge of
split results is exactly one pass; the split rule; bad input is refused with a clear error.

TRITON_INTERPRET must be set before `@triton.jit` runs, so it is set here, at import, as
tests/test_step15_triton.py does; as there, an explicit TRITON_INTERPRET=0 on a machine with a
GPU runs the Triton tests on CUDA (`TRITON_INTERPRET=0 pytest -k triton tests/test_adv04_flash_decoding.py`).
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from advanced.adv04_flash_decoding import flash_decode_cpu as cpu_module  # noqa: E402
from advanced.adv04_flash_decoding.flash_decode_cpu import flash_decode_cpu  # noqa: E402
from advanced.adv04_flash_decoding.flash_decode_torch import (attend_split, flash_decode_torch,  # noqa: E402
                                                              merge_splits)
from advanced.adv04_flash_decoding.splits import (BALANCE, MIN_SPLIT, choose_split_size,  # noqa: E402
                                                  splits_per_sequence)
from step15_flash_attention.reference import gather_kv, random_paged_case, reference_attention  # noqa: E402

needs_kernel = pytest.mark.skipif(cpu_module.load() is None, reason="flash-decoding kernel could not be built")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
# Where the Triton tests run: the interpreter on the CPU unless TRITON_INTERPRET=0 was asked for and a GPU is here.
TRITON_DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"


def on_triton_device(tensors: tuple | dict) -> tuple | dict:
    """A case (tuple) or keyword arguments (dict) with every tensor moved to TRITON_DEVICE."""
    if isinstance(tensors, dict):
        return {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    return tuple(t.to(TRITON_DEVICE) for t in tensors)

# Decode batches (one query per sequence): lengths off the block grid and off every split size below;
# the mixed one has sequences shorter than one split next to one of many splits.
CASES = [[1], [37], [1, 16, 83, 200]]


def decode_case(seq_lens, Hkv, group, bs, D, dtype=torch.float32, seed=0):
    return random_paged_case([1] * len(seq_lens), seq_lens, Hkv, group, bs, D, dtype, seed=seed)


def reference_lse(q, k_pool, v_pool, cu, lens, tables) -> torch.Tensor:
    """log sum_j exp(q . k_j / sqrt(D)) per (sequence, query head), in float64 from the gathered keys."""
    B, Hq, D = q.shape
    out = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        k = gather_kv(k_pool, tables[b], int(lens[b])).double().repeat_interleave(Hq // k_pool.shape[1], 1)
        out[b] = torch.logsumexp(torch.einsum("hd,khd->hk", q[b].double(), k) * D ** -0.5, -1)
    return out


def _splits(bs):
    return [bs, 3 * bs, None, 1000 * bs]   # every block its own split, uneven splits, the rule, one split


KERNELS = [pytest.param(flash_decode_cpu, id="cpu", marks=needs_kernel), pytest.param(flash_decode_torch, id="torch")]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Hkv, group, bs, D", [(2, 2, 16, 128), (1, 4, 4, 64), (3, 1, 8, 32), (2, 3, 5, 48)])
def test_equals_reference(kernel, dtype, tol, Hkv, group, bs, D):
    for i, seq_lens in enumerate(CASES):
        case = decode_case(seq_lens, Hkv, group, bs, D, dtype, seed=i)
        ref, ref_lse = reference_attention(*case), reference_lse(*case)
        for split in _splits(bs):
            out, lse = kernel(*case, split_size=split, return_lse=True)
            assert out.dtype == dtype and out.shape == case[0].shape and lse.shape == case[0].shape[:2]
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=f"{seq_lens}, split {split}")
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_qwen3_shape_long_context_equals_lesson15():
    """16 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16: many splits against lesson 15's decode."""
    from step15_flash_attention.flash_cpu import flash_attention_cpu
    case = decode_case([3001, 700, 1], 8, 2, 16, 128, torch.bfloat16, seed=5)
    ref = reference_attention(*case)
    lesson15 = flash_attention_cpu(*case)
    for split in (256, 512, 4096):
        out = flash_decode_cpu(*case, split_size=split)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), lesson15.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_number_of_splits_does_not_change_the_result():
    """The merge is exact: any cut of the keys gives one pass's output and log-sum-exp (to rounding)."""
    case = decode_case([1000, 999, 17], 2, 2, 16, 64, seed=7)
    one, one_lse = flash_decode_cpu(*case, split_size=1008, return_lse=True)
    for split in (16, 48, 256, 512):
        out, lse = flash_decode_cpu(*case, split_size=split, return_lse=True)
        torch.testing.assert_close(out, one, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse, one_lse, atol=2e-6, rtol=1e-6)


def test_merge_identity():
    """Splits attended on their own and merged with log-sum-exp weights = attention over all keys."""
    g = torch.Generator().manual_seed(0)
    G, n, D = 3, 50, 16
    q, k, v = (torch.randn(G, D, generator=g, dtype=torch.float64), torch.randn(n, D, generator=g, dtype=torch.float64),
               torch.randn(n, D, generator=g, dtype=torch.float64))
    scores = q @ k.T * 0.7
    full, full_lse = scores.softmax(-1) @ v, torch.logsumexp(scores, -1)
    for cuts in ([0, 50], [0, 1, 50], [0, 16, 32, 48, 50], [0, 7, 8, 30, 49, 50], list(range(51))):
        parts = [attend_split(q, k[a:b], v[a:b], 0.7) for a, b in zip(cuts, cuts[1:])]
        o, lse = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        merged, merged_lse = merge_splits(o, lse)
        torch.testing.assert_close(merged, full, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(merged_lse, full_lse, atol=1e-12, rtol=1e-12)
        # Order does not matter, and merged results merge again (a tree of merges is one merge).
        perm = torch.randperm(len(parts), generator=g)
        torch.testing.assert_close(merge_splits(o[perm], lse[perm])[0], full, atol=1e-12, rtol=1e-12)
        if len(parts) >= 2:
            h = len(parts) // 2
            left, right = merge_splits(o[:h], lse[:h]), merge_splits(o[h:], lse[h:])
            again = merge_splits(torch.stack([left[0], right[0]]), torch.stack([left[1], right[1]]))
            torch.testing.assert_close(again[0], full, atol=1e-12, rtol=1e-12)


def test_merge_never_overflows():
    """A split whose mass is e^1000 times another's: the small one weighs 0, nothing is inf or NaN."""
    o = torch.stack([torch.full((2, 4), 3.0), torch.full((2, 4), -5.0)])
    lse = torch.tensor([[1000.0, 0.0], [-1000.0, 0.0]])   # [split, row]
    out, total = merge_splits(o, lse)
    assert torch.equal(out[0], torch.full((4,), 3.0))               # row 0: split 0 has all the mass
    torch.testing.assert_close(out[1], torch.full((4,), -1.0))      # row 1: equal masses, the mean
    torch.testing.assert_close(total, torch.tensor([1000.0, torch.log(torch.tensor(2.0)).item()]))


@needs_kernel
def test_keys_past_the_length_are_never_read():
    bs = 4
    q, k_pool, v_pool, cu, lens, tables = case = decode_case([6, 9, 23], 2, 2, bs, 64, seed=3)
    out = flash_decode_cpu(*case, split_size=2 * bs)
    k2, v2, used = k_pool.clone(), v_pool.clone(), set()
    for b, n in enumerate(lens.tolist()):
        last = int(tables[b, (n - 1) // bs])
        k2[last, :, (n - 1) % bs + 1:], v2[last, :, (n - 1) % bs + 1:] = float("nan"), float("nan")
        used.update(tables[b, :(n - 1) // bs + 1].tolist())
    for blk in set(range(k_pool.shape[0])) - used:
        k2[blk], v2[blk] = float("nan"), float("nan")
    torch.testing.assert_close(flash_decode_cpu(q, k2, v2, cu, lens, tables, split_size=2 * bs), out)


@needs_kernel
def test_result_does_not_depend_on_the_thread_count():
    case = decode_case([500, 3, 260], 2, 2, 16, 128, torch.bfloat16, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flash_decode_cpu(*case, split_size=64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, flash_decode_cpu(*case, split_size=64))   # items and merge order are fixed


def test_split_rule():
    def n(lens, heads, workers):
        return splits_per_sequence(lens, choose_split_size(lens, heads, workers, 16))
    # This lesson's machine: 2 threads, Qwen3-0.6B's 8 KV heads already give 8 items at batch 1.
    assert n([32768], 8, 2) == [1]
    assert n([32768], 1, 2) == [8]                     # one KV head (a TP=8 rank): 8 items for 2 threads
    assert n([32768] * 2, 1, 2) == [4, 4] and n([32768] * 8, 1, 2) == [1] * 8
    # A 64-core CPU: split until there are BALANCE items per thread, stop at batch x heads = 256.
    assert n([32768], 8, 64) == [32] and n([32768] * 16, 8, 64) == [2] * 16 and n([32768] * 32, 8, 64) == [1] * 32
    assert n([4096], 8, 64) == [4096 // MIN_SPLIT]     # never shorter than MIN_SPLIT keys
    # Mixed lengths: the split size is shared, so short sequences keep one split.
    assert n([32768, 100, 100], 1, 2) == [8, 1, 1]
    for heads, workers, bs in [(8, 2, 16), (1, 2, 5), (16, 132, 16), (4, 64, 7)]:
        for B in (1, 3, 8, 40):
            for L in (1, 200, 1000, 32768):
                split = choose_split_size([L] * B, heads, workers, bs)
                assert split % bs == 0 and split >= min(MIN_SPLIT, L)
                if B * heads >= BALANCE * workers:
                    assert splits_per_sequence([L], split) == [1]
    for bad in (dict(seq_lens=[]), dict(seq_lens=[0]), dict(workers=0), dict(block_size=0)):
        with pytest.raises(ValueError):
            choose_split_size(**{**dict(seq_lens=[10], heads=1, workers=2, block_size=16), **bad})


BAD = {
    "decodes only": lambda a: a.update(cu_seqlens_q=torch.tensor([0, 2, 3]), q=torch.cat([a["q"], a["q"][:1]])),
    "split_size": lambda a: a.update(split_size=10),
    "dtype": lambda a: a.update(k_pool=a["k_pool"].bfloat16()),
    "outside the pool": lambda a: a.update(block_tables=a["block_tables"].clone().fill_(10_000)),
    "capacity": lambda a: a.update(seq_lens=torch.tensor([5, 999])),
    "int64": lambda a: a.update(seq_lens=a["seq_lens"].int()),
}


def _bad_cases():
    q, k_pool, v_pool, cu, lens, tables = decode_case([5, 9], 2, 2, 4, 32)
    for what, change in BAD.items():
        args = dict(q=q, k_pool=k_pool, v_pool=v_pool, cu_seqlens_q=cu, seq_lens=lens, block_tables=tables)
        change(args)
        yield what, args


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_input_is_refused(kernel):
    for what, args in _bad_cases():
        with pytest.raises((ValueError, TypeError), match=what):
            kernel(**args)
    assert kernel(*_empty_batch()).shape == (0, 4, 32)                # an empty batch is no error


def _empty_batch():
    _, k_pool, v_pool, *_ = decode_case([5], 2, 2, 4, 32)
    return (torch.empty(0, 4, 32), k_pool, v_pool, torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, 2, dtype=torch.int64))


@needs_kernel
def test_cpu_kernel_refuses_groups_beyond_lesson14s_limit():
    case = decode_case([5], 1, 17, 4, 32)
    with pytest.raises(ValueError, match="query heads per KV head"):
        flash_decode_cpu(*case)


@needs_triton
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Hkv, group, bs, D", [(2, 2, 16, 64), (1, 3, 5, 32)])
def test_triton_equals_reference(dtype, tol, Hkv, group, bs, D):
    from advanced.adv04_flash_decoding.triton_decode import flash_decode_triton
    case = decode_case([1, 16, 83, 37], Hkv, group, bs, D, dtype, seed=1)
    ref, ref_lse = reference_attention(*case), reference_lse(*case)
    case_there = on_triton_device(case)
    for split in (bs, 3 * bs, None):
        out, lse = flash_decode_triton(*case_there, split_size=split, return_lse=True)
        assert out.dtype == dtype and out.shape == case[0].shape and out.device.type == TRITON_DEVICE
        torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol, msg=f"split {split}")
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-4, rtol=1e-5)


@needs_triton
def test_triton_refuses_bad_input():
    from advanced.adv04_flash_decoding.triton_decode import flash_decode_triton
    for what, args in _bad_cases():
        with pytest.raises((ValueError, TypeError), match=what):
            flash_decode_triton(**on_triton_device(args))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        flash_decode_triton(*on_triton_device(decode_case([5, 9], 2, 2, 4, 48)))
    assert flash_decode_triton(*on_triton_device(_empty_batch())).shape == (0, 4, 32)


def test_run_script_help():
    script = Path(__file__).resolve().parent.parent / "advanced" / "adv04_flash_decoding" / "run.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr


def test_without_a_compiler_the_kernel_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))               # no cached library to fall back on
    monkeypatch.setenv("CXX", "no-such-compiler")
    cpu_module.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="flash-decoding kernel unavailable"):
            assert cpu_module.load() is None
        with pytest.raises(RuntimeError, match="not available"):
            flash_decode_cpu(*decode_case([5], 1, 2, 4, 32))
    finally:
        cpu_module.load.cache_clear()
