"""Micro-batches as vLLM V0's virtual engines, and lesson 09's step cut in two.

    KV blocks of every stage's pool:  [ v0: 0 .. n-1 | v1: n .. 2n-1 | ... | v(m-1) ]
    virtual engine v = lesson 13's scheduler + block manager over n blocks, ids shifted by v*n

    lesson 09's step():  schedule -> inputs -> forward -> logits -> sample -> update sequences
    here:                |------ launch (step k) ------|   ...m steps later...   |-- complete --|

A request joins the least loaded virtual engine and stays there. A virtual engine schedules
again only after its last micro-batch completed, so a sequence is never in two micro-batches
in flight, and the scheduler (unchanged) never sees a step whose tokens are not back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedScheduler, PagedSchedulerConfig
from step15_flash_attention.attention import FlashPagedAttention
from step15_flash_attention.engine import create_scheduler
from step17_tensor_parallel.engine import sampled_rows


@dataclass
class InFlight:
    """A launched micro-batch whose sampled rows are not back yet."""
    step: int
    batch: ScheduledBatch
    sampled: list[Sequence]
    logits: torch.Tensor | None                # p = 1: computed at launch; else by rank 0 at completion
    recv: object = None                        # the pending receive of the last stage's rows (p > 1)
    rows: torch.Tensor | None = None           # their final-normed hidden states [N, hidden]
    sends: list = field(default_factory=list)  # (work, tensor) of the hidden sent to stage 1


@dataclass
class VirtualEngine:
    index: int
    scheduler: PagedScheduler
    first_block: int                           # its block ids are shifted by this in the pools
    in_flight: InFlight | None = None

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def attention(self, pool, batch: ScheduledBatch, backend) -> FlashPagedAttention:
        """Lesson 15's step attention for this batch, its block ids moved to this engine's slice."""
        attn = FlashPagedAttention(pool, batch, backend)
        if self.first_block:
            attn.block_tables = attn.block_tables + self.first_block
            attn.slot_mapping = attn.slot_mapping + self.first_block * pool.block_size
            attn.rows = None if attn.rows is None else pool.head_rows(attn.slot_mapping)
        return attn

    def complete(self, tokens: list[int], eos_ids: list[int]) -> InFlight:
        """The second half of lesson 09's step, for the micro-batch in flight: its tokens are in."""
        f, self.in_flight = self.in_flight, None
        for seq, n in zip(f.batch.seqs, f.batch.num_tokens):
            seq.num_computed_tokens += n
        self.scheduler.after_step(f.batch)
        now = time.perf_counter()
        for seq, tok in zip(f.sampled, tokens):
            seq.token_ids.append(tok)
            seq.token_times.append(now)
            reason = seq.params.finish_reason(tok, len(seq.output_token_ids), eos_ids)
            if reason:
                self.scheduler.finish(seq, reason)
        return f


def virtual_engines(config: PagedSchedulerConfig, num_blocks: int, m: int) -> list[VirtualEngine]:
    if m < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {m}")
    per = num_blocks // m
    if per < 1:
        raise ValueError(f"{num_blocks} KV blocks cannot be shared by {m} micro-batches: raise kv_cache_bytes")
    return [VirtualEngine(k, create_scheduler(config, per), k * per) for k in range(m)]


def step_inputs(batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[int], list[Sequence]]:
    """Token ids, positions, sampled rows and sampled sequences: the first half of lesson 09's step."""
    ids, positions = [], []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
    sampled = [s for s, n in zip(batch.seqs, batch.num_tokens) if s.num_computed_tokens + n == s.num_tokens]
    return torch.tensor(ids), torch.tensor(positions), sampled_rows(batch), sampled
