"""Lesson 14's engine with one attention backend, chosen once: every layer makes one call.

The scheduler, block manager, prefix cache, packed linears and counters are lesson 14's. What
changes is the attention backend the model is handed each step (attention.py) and the pool it
reads: the chosen backend decides the pool's layout and, where its kernel needs it, the block
size (flash-attn 2: multiples of 256).
"""
from __future__ import annotations

import dataclasses

from step09_continuous_batching.scheduler import ScheduledBatch
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention.attention import FlashPagedAttention
from step15_flash_attention.backends import choose_backend


class FlashEngine(BatchedEngine):
    def __init__(self, model, scheduler=None, *args, attention_backend: str = "auto", **kwargs):
        self.attention = choose_backend(attention_backend, next(model.parameters()).device)
        self.pool_class = self.attention.pool_class       # read by make_scheduler below
        super().__init__(model, scheduler, *args, **kwargs)

    def make_scheduler(self, config):
        multiple = self.attention.block_size_multiple
        if isinstance(config, PagedSchedulerConfig) and config.block_size % multiple:
            config = dataclasses.replace(config, block_size=multiple)     # the kernel's constraint wins
        return super().make_scheduler(config)

    def make_backend(self, batch: ScheduledBatch) -> FlashPagedAttention:
        self.count_prompt_tokens(batch)
        return FlashPagedAttention(self.kv_pool, batch, self.attention)
