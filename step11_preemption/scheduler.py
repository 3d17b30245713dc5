"""Preemption: the KV cache has a budget; when a running sequence cannot grow, someone yields.

The victim is the most recently admitted running sequence (it has the least work to lose). Its
KV is freed, its generated tokens are kept, and it goes back to the *front* of the waiting
queue. When it is admitted again, prompt + generated tokens are recomputed as one long prefill
(recompute, as vLLM does by default) and generation continues exactly where it stopped.
The oldest running sequence can always grow (a request that could never fit alone is rejected
when it arrives), so the engine always makes progress.
"""
from __future__ import annotations

from dataclasses import dataclass

from step09_continuous_batching.scheduler import ScheduledBatch, SchedulerConfig
from step09_continuous_batching.sequence import Sequence, SequenceStatus
from step10_chunked_prefill.scheduler import ChunkedPrefillScheduler


@dataclass
class PreemptionSchedulerConfig(SchedulerConfig):
    max_kv_tokens: int = 8192   # tokens of K/V all running sequences may hold together

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {self.max_kv_tokens}")


class PreemptingScheduler(ChunkedPrefillScheduler):
    config: PreemptionSchedulerConfig

    def __init__(self, config: PreemptionSchedulerConfig):
        super().__init__(config)
        self.num_preemptions = 0

    def check_admissible(self, seq: Sequence) -> None:
        # The last sampled token is never fed back, so a request holds at most P + M - 1 tokens.
        need = seq.num_prompt_tokens + seq.params.max_tokens - 1
        if need > self.config.max_kv_tokens:
            raise ValueError(f"request needs up to {need} tokens of KV cache (prompt {seq.num_prompt_tokens} + "
                             f"max_tokens {seq.params.max_tokens} - 1) but max_kv_tokens is "
                             f"{self.config.max_kv_tokens}: it could never finish")

    # ---- KV accounting: tokens here; lesson 12 overrides these four with real blocks --------
    def begin_step(self) -> None:
        self._free = self.config.max_kv_tokens - sum(s.num_computed_tokens for s in self.running)

    def room(self, seq: Sequence) -> int:
        """New tokens `seq` could add to the KV cache right now."""
        return self._free

    def reserve(self, seq: Sequence, n: int) -> None:
        self._free -= n

    def release(self, seq: Sequence, scheduled: int) -> None:
        """Give back what a preempted sequence held plus what it was granted this step."""
        self._free += seq.num_computed_tokens + scheduled

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status, seq.kv_cache, seq.num_computed_tokens = SequenceStatus.WAITING, None, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        preempted = False
        self.begin_step()

        def evict(victim: Sequence) -> None:
            nonlocal budget, preempted
            scheduled = 0
            if victim in batch.seqs:       # scheduled earlier this step: hand its share back
                i = batch.seqs.index(victim)
                scheduled = batch.num_tokens.pop(i)
                batch.seqs.pop(i)
                budget += scheduled
            self.release(victim, scheduled)
            self.preempt(victim)
            preempted = True

        def grant(seq: Sequence) -> None:
            nonlocal budget
            n = min(seq.num_uncomputed_tokens, budget, self.room(seq))
            if n < 1:
                return
            self.reserve(seq, n)
            batch.add(seq, n)
            budget -= n

        # Decodes first, then prompt chunks of running sequences, oldest first; each needs KV room.
        for decoding in (True, False):
            for seq in list(self.running):
                if seq not in self.running or (seq.num_uncomputed_tokens == 1) != decoding or not budget:
                    continue
                while self.room(seq) < 1 and self.running[-1] is not seq:
                    evict(self.running[-1])
                if self.room(seq) < 1:     # it is the newest one itself: it yields
                    evict(seq)
                    continue
                grant(seq)
        # New requests only when nobody had to yield this step (otherwise we would thrash).
        while (not preempted and budget and self.waiting and self.room(self.waiting[0]) > 0
               and len(self.running) < self.config.max_num_seqs):
            self.admit(self.waiting.popleft())
            grant(self.running[-1])
        return batch

    def admit(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
