"""A step's sequences cut into micro-batches, and the plan rank 0 sends the FFN side each step.

    step batch:  seq0 (5 tokens) | seq1 (1) | seq2 (1) | seq3 (1) | seq4 (1)     T = 9 rows
    m = 2:       micro-batch 0 = seq0           rows 0..4   (5 tokens)
                 micro-batch 1 = seq1..seq4     rows 5..8   (4 tokens)

A micro-batch is a run of whole sequences, so its rows are a contiguous slice of the step's
flattened tokens and its attention needs only its own sequences' KV: attention never mixes
micro-batches, the MLP works row by row, and the step's output is the micro-batches' outputs
put back in order. The cut balances tokens (the FFN's work) as far as whole sequences allow.

The plan (one small message per step over each FFN worker's control socket): the step number,
the layers to run and, for each attention rank, each micro-batch's token count. Micro-batch i
goes to FFN rank 1 + i % n_ffn (`ffn_rank`), so with 2 FFN workers and m = 2 each one serves one
micro-batch. With two attention ranks (2:1) a sequence lives on attention rank seq_id % 2
(`owner`), and the FFN rank gathers micro-batch i of both into one matmul.

    ranks:  0 = attention (scheduler, sampler) | 1 .. n_ffn = FFN | n_ffn + 1 .. = more attention
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from step09_continuous_batching.scheduler import ScheduledBatch


@dataclass
class MicroBatch:
    index: int
    batch: ScheduledBatch        # its sequences (a slice of the step's), for its own step attention
    start: int                   # its rows in the step's flattened tokens: [start, end)
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV its attention reads (each sequence's context after this step)."""
        return sum(s.num_computed_tokens + n for s, n in zip(self.batch.seqs, self.batch.num_tokens))


def split_batch(batch: ScheduledBatch, m: int) -> list[MicroBatch]:
    """At most m micro-batches (fewer when the step has fewer sequences), none empty, in order,
    each cut placed where the tokens before it come closest to k/m of the step's."""
    if m < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {m}")
    B = len(batch.seqs)
    if B == 0:
        return []
    m = min(m, B)
    prefix = [0]
    for n in batch.num_tokens:
        prefix.append(prefix[-1] + n)
    total, cuts = prefix[-1], [0]
    for k in range(1, m):
        lo, hi = cuts[-1] + 1, B - (m - k)             # leave at least one sequence for each later one
        cuts.append(min(range(lo, hi + 1), key=lambda j: abs(prefix[j] * m - k * total)))
    cuts.append(B)
    out = []
    for i in range(m):
        a, b = cuts[i], cuts[i + 1]
        out.append(MicroBatch(i, ScheduledBatch(batch.seqs[a:b], batch.num_tokens[a:b]), prefix[a], prefix[b]))
    return out


def ffn_rank(micro_batch: int, n_ffn: int) -> int:
    """The FFN worker that serves this micro-batch at every layer."""
    return 1 + micro_batch % n_ffn


def attention_rank(a: int, n_ffn: int) -> int:
    """The process rank of attention worker a (a = 0 is rank 0; the others come after the FFN ranks)."""
    return 0 if a == 0 else n_ffn + a


def owner(seq_id: int, n_attention: int) -> int:
    """The attention worker that holds a sequence's KV and computes its attention, for its whole
    life (a fixed rule, so a preempted sequence comes back to the pool that holds nothing of it)."""
    return seq_id % n_attention


@dataclass
class StepPlan:
    step: int
    num_layers: int
    tokens: list[list[int]]      # per attention worker, per micro-batch (an idle worker: [])

    def to_bytes(self) -> bytes:
        flat = [n for mine in self.tokens for n in (len(mine), *mine)]
        return torch.tensor([self.step, self.num_layers, len(self.tokens), *flat]).numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepPlan":
        values = torch.frombuffer(bytearray(data), dtype=torch.long).tolist()
        step, layers, n_attention = values[:3]
        tokens, at = [], 3
        for _ in range(n_attention):
            m = values[at] if at < len(values) else -1
            if m < 0 or at + 1 + m > len(values):
                break
            tokens.append(values[at + 1:at + 1 + m])
            at += 1 + m
        if len(tokens) != n_attention or at != len(values):
            raise ValueError(f"a step plan of {len(data)} bytes does not describe {n_attention} attention workers")
        return cls(step, layers, tokens)

    def senders(self, i: int, n_ffn: int) -> list[tuple[int, int]]:
        """(attention rank, tokens) of micro-batch i, for every attention worker that has one."""
        return [(attention_rank(a, n_ffn), mine[i]) for a, mine in enumerate(self.tokens) if i < len(mine)]

    @property
    def num_micro_batches(self) -> int:
        return max((len(mine) for mine in self.tokens), default=0)
