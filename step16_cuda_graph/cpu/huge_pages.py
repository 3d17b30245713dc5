"""The KV pool on 2 MB pages: lesson 14's head-major pool, its memory asked for in huge pages.

Why: a decode step reads every sequence's K and V, one 4 KB piece per (block, KV head) at
block size 16 and head dim 128, from wherever the block manager put the block. On 4 KB pages
every piece sits on a page of its own, so every piece costs the CPU a page-table walk before
its first byte arrives (the TLB holds a few thousand pages; a pool of hundreds of MB has
hundreds of thousands). On 2 MB pages one TLB entry covers 512 pieces.

    4 KB pages: piece -> TLB miss -> page walk -> read      (one walk per 4 KB read)
    2 MB pages: piece -> TLB hit -> read                    (a walk per 2 MB)

Linux hands out 2 MB pages to a mapping that asks for them with madvise(MADV_HUGEPAGE) when
transparent huge pages are in "madvise" or "always" mode (/sys/kernel/mm/transparent_hugepage/
enabled); the request must come before the memory is first written, so the pool's tensors are
allocated empty, advised, then zeroed. Where the kernel says no (another OS, THP "never",
no 2 MB page free) the pool is the ordinary one: only speed differs, never a value.
`python step15_flash_attention/bench.py decode` reads a pool both ways and prints the rates.
"""
from __future__ import annotations

import mmap

import torch

from step04_transformer.config import ModelConfig
from step14_batched_forward.kv_pool import HeadMajorKVPool

HUGE_PAGE = 2 << 20


def huge_page_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An unwritten CPU tensor (it reads as zeros) on memory advised onto 2 MB pages before its
    first write, or None where that cannot be asked for (no MADV_HUGEPAGE, the kernel refuses,
    less than one huge page). The memory is a fresh private anonymous mapping of its own (malloc
    may hand back heap pages that were written already, which no advice turns into huge pages),
    trimmed to start on a 2 MB boundary so that whole huge pages cover it."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)            # keeps the mapping alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
    except OSError:
        return None
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on 2 MB pages (huge_page_memory); plain torch.zeros where not possible."""
    memory = huge_page_memory(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if memory is None else memory.zero_()


# Tensors under a huge page (most weights of a 135M model) share mappings of this size, back to back.
SHARED_MAPPING = 16 * HUGE_PAGE
_shared: list = [None, 0]            # the mapping small copies go into now, and the bytes used of it


def huge_page_copy(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous copy of CPU tensor `t` on 2 MB pages, or None where they cannot be asked for.
    A decode step of one to four rows streams every weight once: on 4 KB pages that is a TLB miss
    every 4 KB, on 2 MB pages one every 2 MB (`cpu/bench.py weights` reads weights both ways).
    A tensor smaller than a huge page goes into a mapping shared with the next ones (each
    mapping lives as long as one of its tensors does)."""
    nbytes = t.numel() * t.element_size()
    if nbytes >= HUGE_PAGE:
        memory = huge_page_memory(tuple(t.shape), t.dtype)
        return None if memory is None else memory.copy_(t)
    mapping, used = _shared
    start = -(-used // 64) * 64                                    # cache-line aligned
    if mapping is None or start + nbytes > mapping.numel():
        mapping, start = huge_page_memory((SHARED_MAPPING,), torch.uint8), 0
        if mapping is None:
            return None
    _shared[:] = [mapping, start + nbytes]
    return mapping[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t)


class HugePageKVPool(HeadMajorKVPool):
    """Lesson 14's pool (same layout, same methods), its K and V tensors on 2 MB pages."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if torch.device(device).type != "cpu":
            super().__init__(cfg, num_blocks, block_size, dtype, device)
            return
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.k = [huge_page_zeros(shape, dtype) for _ in range(cfg.num_layers)]
        self.v = [huge_page_zeros(shape, dtype) for _ in range(cfg.num_layers)]
        self.num_blocks, self.block_size, self.num_kv_heads = num_blocks, block_size, cfg.num_kv_heads


def huge_page_bytes() -> int:
    """Anonymous memory of this process on huge pages (Linux's AnonHugePages), in bytes; 0 elsewhere."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
