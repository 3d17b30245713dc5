"""The engine with a paged KV cache: one pool, block tables, a slot mapping."""
from __future__ import annotations

from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import ScheduledBatch
from step12_paged_attention.block_manager import BlockManager
from step12_paged_attention.kv_pool import KVPool, PagedAttention
from step12_paged_attention.scheduler import PagedScheduler, PagedSchedulerConfig


class PagedEngine(LLMEngine):
    scheduler_class = PagedScheduler
    block_manager_class = BlockManager
    pool_class = KVPool

    def __init__(self, model, config: PagedSchedulerConfig | None = None, *args, **kwargs):
        config = PagedSchedulerConfig() if config is None else config
        if not isinstance(config, PagedSchedulerConfig):
            raise TypeError("PagedEngine needs a PagedSchedulerConfig (block_size, kv_cache_bytes)")
        weight = model.model.embed_tokens.weight
        # The pool first: the block manager hands out its blocks.
        self.kv_pool = self.pool_class.from_memory_budget(model.config, config.kv_cache_bytes,
                                                          config.block_size, weight.dtype, weight.device)
        super().__init__(model, config, *args, **kwargs)

    def make_scheduler(self, config: PagedSchedulerConfig) -> PagedScheduler:
        return self.scheduler_class(config, self.block_manager_class(self.kv_pool.num_blocks, config.block_size))

    def prepare_kv(self, batch: ScheduledBatch) -> None:
        pass  # the scheduler already allocated every block this step writes to

    def make_attention(self, batch: ScheduledBatch) -> PagedAttention:
        return PagedAttention(self.kv_pool, batch)
