"""Lesson 09's engine with the chunked-prefill scheduler: the only change is the policy."""
from __future__ import annotations

from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import SchedulerConfig
from step10_chunked_prefill.scheduler import ChunkedPrefillScheduler


class ChunkedPrefillEngine(LLMEngine):
    def make_scheduler(self, config: SchedulerConfig) -> ChunkedPrefillScheduler:
        return ChunkedPrefillScheduler(config)
