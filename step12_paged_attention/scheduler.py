"""Lesson 11's preempting scheduler, with its KV budget made of real blocks."""
from __future__ import annotations

from dataclasses import dataclass

from step09_continuous_batching.scheduler import SchedulerConfig
from step09_continuous_batching.sequence import Sequence
from step11_preemption.scheduler import PreemptingScheduler
from step12_paged_attention.block_manager import BlockManager


@dataclass
class PagedSchedulerConfig(SchedulerConfig):
    block_size: int = 16
    kv_cache_bytes: int = 256 * 2**20   # the pool's size; vLLM derives it from gpu_memory_utilization

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


class PagedScheduler(PreemptingScheduler):
    def __init__(self, config: PagedSchedulerConfig, block_manager: BlockManager):
        super().__init__(config)
        self.block_manager = block_manager

    def check_admissible(self, seq: Sequence) -> None:
        bm = self.block_manager
        need = bm.blocks_for(seq.num_prompt_tokens + seq.params.max_tokens - 1)
        if need > bm.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks (prompt {seq.num_prompt_tokens} + "
                             f"max_tokens {seq.params.max_tokens} - 1 tokens) but the pool has "
                             f"{bm.num_blocks}: it could never finish")

    def begin_step(self) -> None:
        pass

    def room(self, seq: Sequence) -> int:
        return self.block_manager.room(seq)

    def reserve(self, seq: Sequence, n: int) -> None:
        self.block_manager.allocate(seq, seq.num_computed_tokens + n)

    def release(self, seq: Sequence, scheduled: int) -> None:
        self.block_manager.free(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        super().finish(seq, reason)

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_blocks - self.block_manager.num_free_blocks
