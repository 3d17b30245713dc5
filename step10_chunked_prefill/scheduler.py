"""Chunked prefill: every step has a token budget; decodes take it first, prompts get the rest.

    lesson 09:  step k   [ 2000-token prefill ...................... ]   decodes wait
                step k+1 [d d d d]
    lesson 10:  step k   [d d d d | prefill chunk 1 (budget - 4) ]
                step k+1 [d d d d | prefill chunk 2             ]       decodes never stall

A long prompt now costs running requests a little on every step instead of a lot on one.
The engine of lesson 09 needs no change: it already computes `num_tokens[i]` new tokens per
sequence and samples only when a sequence's last token has been computed.
"""
from __future__ import annotations

from step09_continuous_batching.scheduler import ScheduledBatch, Scheduler
from step09_continuous_batching.sequence import Sequence, SequenceStatus


class ChunkedPrefillScheduler(Scheduler):
    def check_admissible(self, seq: Sequence) -> None:
        pass  # any prompt fits now: it is cut into chunks of at most the budget

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        # 1. one token for every decoding sequence, oldest first.
        for seq in self.running:
            if budget and seq.num_uncomputed_tokens == 1:
                batch.add(seq, 1)
                budget -= 1
        # 2. the next chunk of prompts already started (a running sequence still prefilling).
        for seq in self.running:
            if budget and seq.num_uncomputed_tokens > 1:
                n = min(seq.num_uncomputed_tokens, budget)
                batch.add(seq, n)
                budget -= n
        # 3. new requests, first come first served, with whatever budget is left.
        while budget and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, n)
            budget -= n
        return batch
