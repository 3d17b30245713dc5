"""How a decode batch is cut into splits: the rule, and the checks every flash-decoding kernel shares.

A decode reads its sequence's whole K/V for one query row. Without splitting, the work items
of a step are (sequence, KV head) pairs: batch x kv_heads of them. When that is fewer than
the workers (CPU threads, GPU SMs), some workers idle while others walk long contexts alone.
Flash-decoding cuts each sequence's keys into splits of `split_size` keys (whole blocks), so
the items become (sequence, KV head, split), and then merges the splits' partial results.

The rule (`choose_split_size`), in words:

    share = kv_heads * sum(seq_lens) / workers     keys each worker reads if the work is even
    split = max(MIN_SPLIT, share / BALANCE)        no item longer than a quarter of a share,
                                                   none shorter than MIN_SPLIT keys
    a sequence of L keys gets ceil(L / split) splits (1 when split >= L)

For a batch of equal lengths L that is

    num_splits = min(ceil(BALANCE * workers / (batch * kv_heads)), L / MIN_SPLIT), at least 1

so splitting stops as soon as batch x kv_heads >= BALANCE x workers.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

MIN_SPLIT = 256   # keys: each split costs a partial result (group x D floats) to write and merge
BALANCE = 4       # no item longer than 1/4 of a worker's share: dynamic scheduling then evens the
                  # workers out to within ~1/4 of an item, whatever the mix of lengths


def choose_split_size(seq_lens: Sequence[int], heads: int, workers: int, block_size: int,
                      min_split: int = MIN_SPLIT, balance: int = BALANCE) -> int:
    """Keys per split, a multiple of `block_size`; >= the longest sequence means "do not split".

    `heads`: the items one sequence makes without splitting (KV heads for the CPU kernel,
    which does a KV head's `group` query heads together; query heads for the Triton kernel).
    `workers`: threads on a CPU, SMs on a GPU.
    """
    if min(heads, workers, block_size, min_split, balance) < 1:
        raise ValueError(f"heads, workers, block_size, min_split and balance must be >= 1, got "
                         f"{heads}, {workers}, {block_size}, {min_split}, {balance}")
    lens = [int(n) for n in seq_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"seq_lens must be a non-empty list of lengths >= 1, got {lens}")
    share = heads * sum(lens) / workers
    split = max(min_split, math.ceil(share / balance))
    split = min(split, max(lens))                 # one split already covers the longest sequence
    return -(-split // block_size) * block_size   # whole blocks: a split starts on a block boundary


def splits_per_sequence(seq_lens: Sequence[int], split_size: int) -> list[int]:
    return [-(-int(n) // split_size) for n in seq_lens]


def check_decode_inputs(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                        block_tables: Tensor, dtypes: set[torch.dtype]) -> None:
    """Lesson 15's checks (shapes, dtypes, lengths within the tables, block ids in the pool), then ours."""
    from step15_flash_attention.flash_cpu import check_inputs
    check_inputs(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, dtypes)
    B = seq_lens.shape[0]
    if q.shape[0] != B or not torch.equal(cu_seqlens_q, torch.arange(B + 1, device=cu_seqlens_q.device)):
        raise ValueError("flash-decoding takes decodes only (exactly one query per sequence, "
                         "cu_seqlens_q = 0, 1, ..., B); give prompt chunks to lesson 15's kernel")


def resolve_split_size(split_size: int | None, seq_lens: Tensor, heads: int, workers: int, block_size: int) -> int:
    """The caller's split size, checked, or the rule's choice when it gave none."""
    if split_size is None:
        return choose_split_size(seq_lens.tolist(), heads, workers, block_size) if len(seq_lens) else block_size
    if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size < 1 or split_size % block_size:
        raise ValueError(f"split_size must be a positive multiple of the block size {block_size}, "
                         f"got {split_size!r}")
    return split_size
