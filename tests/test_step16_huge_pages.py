"""Lesson 16, part 2: the KV pool on 2 MB pages (huge_pages.py). The same layout and values as
lesson 14's pool whatever the OS grants; the pages themselves where Linux grants them (the fast
path's engine is checked to build its pool this way in test_step16_cpu_fast_path.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from step04_transformer.loader import load_model
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step16_cuda_graph.cpu.huge_pages import HUGE_PAGE, HugePageKVPool, huge_page_bytes, huge_page_copy, huge_page_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_of_any_size_are_zeros_of_that_shape(dtype):
    for shape in [(3, 5), (9, 2, 16, 128), (600, 8, 16, 64)]:            # below and above one huge page
        t = huge_page_zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason=f"transparent huge pages: {_thp_mode()}")
def test_a_large_pool_lands_on_huge_pages():
    before = huge_page_bytes()
    t = huge_page_zeros((16 * HUGE_PAGE // 2,), torch.bfloat16)           # 16 huge pages' worth
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    granted = huge_page_bytes() - before
    if granted == 0:                     # THP on, but no free 2 MB page in the machine's memory now
        pytest.skip("the kernel granted no 2 MB page (memory too fragmented): nothing to check")
    assert granted >= 8 * HUGE_PAGE                                       # the kernel may keep a few back
    del t


def test_pool_layout_and_methods_are_lesson14s(tiny_qwen3_dir):
    cfg = load_model(tiny_qwen3_dir, torch.float32).config
    mine, theirs = HugePageKVPool(cfg, 40, 4, torch.float32), HeadMajorKVPool(cfg, 40, 4, torch.float32)
    assert [t.shape for t in mine.k] == [t.shape for t in theirs.k] and mine.nbytes == theirs.nbytes
    slots = torch.tensor([0, 5, 17, 159])
    k = torch.randn(4, cfg.num_kv_heads, cfg.head_dim)
    for pool in (mine, theirs):
        pool.write(1, slots, k, -k)
    assert all(torch.equal(a, b) for a, b in zip(mine.k + mine.v, theirs.k + theirs.v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_hold_the_values_and_small_ones_share_a_mapping(dtype, monkeypatch):
    """huge_page_copy (the fast path's weight copies): the same values, contiguous, aligned to a
    cache line; tensors under a huge page go back to back into one shared mapping (a fresh one
    here: what earlier copies in this process left in the current mapping is not this test's)."""
    from step16_cuda_graph.cpu import huge_pages
    monkeypatch.setattr(huge_pages, "_shared", [None, 0])
    small = [torch.randn(7, 33).to(dtype), torch.randn(300, 576).to(dtype), torch.randn(5).to(dtype)]
    large = torch.randn(3 * HUGE_PAGE // 4 + 5).to(dtype)          # over one huge page
    copies = [huge_page_copy(t) for t in small + [large]]
    if any(c is None for c in copies):
        pytest.skip("this OS gives no memory advised onto huge pages (no MADV_HUGEPAGE or refused)")
    for t, c in zip(small + [large], copies):
        assert torch.equal(t, c) and c.is_contiguous() and c.data_ptr() % 64 == 0
        assert c.data_ptr() != t.data_ptr()
    first, second = copies[0], copies[1]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()    # one mapping
    assert copies[-1].data_ptr() % HUGE_PAGE == 0                 # a large one starts on a huge page
