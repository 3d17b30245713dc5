"""Cutting a step's batch into two micro-batches, and the step attention of each.

    batch (rows in scheduler order)   seq 0: 40-token prompt chunk | seq 1: 1 | seq 2: 1 | seq 3: 1
    cut after seq 0                   A = seq 0 (40 rows)          | B = seq 1-3 (3 rows)
    cut after seq 1                   A = seq 0-1 (41 rows)        | B = seq 2-3 (2 rows)  ...

A micro-batch is a run of whole sequences (SGLang's two-batch overlap splits the same way):
attention never mixes two sequences, so each micro-batch's attention needs only its own
sequences' KV, and its rows are a contiguous slice of the step's tensors (no gather, no copy).
Of the B - 1 possible cuts the one that leaves the two halves closest in tokens is taken:
the overlap hides one micro-batch's all-reduce behind the other's compute, so the two should
take about as long. One sequence cannot be cut this way: the step then runs as one lane.

Every rank computes the same cut from the same numbers (the step's cu_seqlens_q, which rank 0
sends anyway), so the cut itself costs no message.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from step15_flash_attention.attention import FlashPagedAttention
from step14_batched_forward.kv_pool import HeadMajorKVPool


@dataclass(frozen=True)
class MicroBatch:
    name: str             # "A" or "B" on the timeline; "all" when the step is not split
    seqs: range           # which of the step's sequences
    rows: range           # which rows (tokens) of the step's tensors

    @property
    def num_tokens(self) -> int:
        return len(self.rows)


def balanced_cut(q_lens: Sequence[int]) -> int | None:
    """The k in 1 .. B-1 that makes sequences [0, k) and [k, B) closest in tokens (the first such
    k on a tie); None for fewer than two sequences."""
    if any(n < 1 for n in q_lens):
        raise ValueError(f"every sequence of a step has at least one token, got {list(q_lens)}")
    if len(q_lens) < 2:
        return None
    total, prefix, best, best_gap = sum(q_lens), 0, None, None
    for k in range(1, len(q_lens)):
        prefix += q_lens[k - 1]
        gap = abs(2 * prefix - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    return best


def split_micro_batches(q_lens: Sequence[int], overlap: bool = True) -> list[MicroBatch]:
    """Two micro-batches balanced by tokens, or one ("all") when not overlapping or B < 2."""
    q_lens = [int(n) for n in q_lens]
    k = balanced_cut(q_lens) if overlap else None
    if k is None:
        return [MicroBatch("all", range(len(q_lens)), range(sum(q_lens)))]
    cut = sum(q_lens[:k])
    return [MicroBatch("A", range(0, k), range(0, cut)),
            MicroBatch("B", range(k, len(q_lens)), range(cut, sum(q_lens)))]


def q_lens_of(attn: FlashPagedAttention) -> list[int]:
    """Tokens per sequence of a step, read from its step attention (rank 0's or a worker's)."""
    cu = attn.cu_seqlens_q.tolist()
    return [b - a for a, b in zip(cu, cu[1:])]


class SubBatchAttention(FlashPagedAttention):
    """Lesson 15's step attention restricted to a micro-batch's sequences: the same pool and
    kernel, its slice of the varlen description (query offsets rebased to its first row)."""

    def __init__(self, step: FlashPagedAttention, mb: MicroBatch):
        s, r = slice(mb.seqs.start, mb.seqs.stop), slice(mb.rows.start, mb.rows.stop)
        self.pool, self.kernel = step.pool, step.kernel
        cu: Tensor = step.cu_seqlens_q[mb.seqs.start:mb.seqs.stop + 1]
        self.cu_seqlens_q = cu - cu[0]
        self.seq_lens, self.block_tables = step.seq_lens[s], step.block_tables[s]
        self.slot_mapping = step.slot_mapping[r]
        self.rows = self.pool.head_rows(self.slot_mapping) if isinstance(self.pool, HeadMajorKVPool) else None
