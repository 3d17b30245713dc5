"""The paged engine with prefix caching: look prefixes up on admission, cache blocks after each step."""
from __future__ import annotations

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.engine import PagedEngine
from step12_paged_attention.scheduler import PagedScheduler
from step13_prefix_cache.block_manager import PrefixCachingBlockManager


class PrefixCachingScheduler(PagedScheduler):
    block_manager: PrefixCachingBlockManager

    def admit(self, seq: Sequence) -> None:
        super().admit(seq)
        if not seq.block_table:                    # fresh, or recomputing after a preemption
            self.block_manager.match_prefix(seq)

    def after_step(self, batch: ScheduledBatch) -> None:
        # Only now are these blocks' K/V really written, so only now may others reuse them.
        for seq in batch.seqs:
            if seq.block_table is not None:
                self.block_manager.cache_full_blocks(seq)


class PrefixCachingEngine(PagedEngine):
    scheduler_class = PrefixCachingScheduler
    block_manager_class = PrefixCachingBlockManager
