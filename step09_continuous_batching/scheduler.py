"""First-come-first-served scheduling with a waiting and a running queue.

Every step the scheduler picks what the model runs next:
  * if requests are waiting and fit (max_num_seqs running, max_num_batched_tokens per step),
    admit them and run their whole prompts (a prefill step);
  * otherwise run one decode token for every running sequence (a decode step).
A finished sequence leaves at once and its seat is taken at the next step: that is the whole
difference with static batching. Lesson 10 mixes prefill and decode in one step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from step09_continuous_batching.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16               # sequences running at once (the batch size of decodes)
    max_num_batched_tokens: int = 2048   # tokens one forward may take

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # new tokens to compute, per sequence

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def check_admissible(self, seq: Sequence) -> None:
        """Reject at once a request that could never be scheduled, instead of letting it hang."""
        if seq.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt of {seq.num_prompt_tokens} tokens exceeds max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} (lesson 10's chunked prefill lifts this)")

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if batch.total_tokens + seq.num_uncomputed_tokens > self.config.max_num_batched_tokens:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, seq.num_uncomputed_tokens)
        if batch:
            return batch                      # prefill step: running decodes wait one step
        for seq in self.running:
            batch.add(seq, 1)
        return batch

    def after_step(self, batch: ScheduledBatch) -> None:
        """Called once the batch's K/V are computed (lesson 13 caches full blocks here)."""

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.kv_cache = None                         # its KV memory is free the moment it ends
        self.running.remove(seq)
