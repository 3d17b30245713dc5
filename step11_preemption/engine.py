"""Lesson 10's engine with a KV budget enforced by the preempting scheduler."""
from __future__ import annotations

from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import SchedulerConfig
from step11_preemption.scheduler import PreemptingScheduler, PreemptionSchedulerConfig


class PreemptingEngine(LLMEngine):
    def make_scheduler(self, config: SchedulerConfig) -> PreemptingScheduler:
        if not isinstance(config, PreemptionSchedulerConfig):
            raise TypeError("PreemptingEngine needs a PreemptionSchedulerConfig (it carries max_kv_tokens)")
        return PreemptingScheduler(config)
