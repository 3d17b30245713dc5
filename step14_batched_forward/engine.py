"""Lesson 13's engine with the batched varlen step attention, and the counters a server needs."""
from __future__ import annotations

from dataclasses import dataclass

from step09_continuous_batching.scheduler import ScheduledBatch
from step13_prefix_cache.engine import PrefixCachingEngine
from step14_batched_forward import kernel
from step14_batched_forward.attention import VarlenPagedAttention, Workspace
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step14_batched_forward.packed_linear import PackedLinear, count_modules, pack_linears


@dataclass
class EngineStats:
    """A snapshot of what lesson 20 will serve as Prometheus metrics."""
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int     # prompt tokens looked up
    prefix_cache_hits: int        # of which found in the cache
    num_preemptions: int
    prompt_tokens: int            # prompt tokens computed (prefix hits excluded)
    generation_tokens: int


class TokenCounters:
    """Prompt tokens computed (prefix-cache hits excluded) and tokens generated, for stats()."""

    def __init__(self):
        self.prompt_tokens = self.generation_tokens = 0

    def count_prompt_tokens(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)

    def stats(self, scheduler) -> EngineStats:
        bm = scheduler.block_manager
        return EngineStats(len(scheduler.running), len(scheduler.waiting), scheduler.num_used_blocks,
                           bm.num_blocks, bm.query_tokens, bm.hit_tokens, scheduler.num_preemptions,
                           self.prompt_tokens, self.generation_tokens)


class BatchedEngine(PrefixCachingEngine):
    pool_class = HeadMajorKVPool

    def __init__(self, model, *args, pack_weights: bool = True, use_kernel: bool = True, **kwargs):
        # Linears get their weights pre-packed for oneDNN, once: bf16 where oneDNN computes bf16,
        # float32 on x86 (packed_linear.py). The engine keeps the packed copy; the model it was
        # given is not changed.
        if pack_weights:
            model = pack_linears(model)
        super().__init__(model, *args, **kwargs)
        self.num_packed = count_modules(self.model, PackedLinear)
        self.counters = TokenCounters()
        self.workspace = Workspace()
        # Decodes go through the C++ paged kernel when it builds (else the torch gather path).
        self.use_kernel = use_kernel and kernel.load() is not None

    @property
    def prompt_tokens(self) -> int:
        return self.counters.prompt_tokens

    @property
    def generation_tokens(self) -> int:
        return self.counters.generation_tokens

    def make_attention(self, batch: ScheduledBatch) -> VarlenPagedAttention:
        self.counters.count_prompt_tokens(batch)
        return VarlenPagedAttention(self.kv_pool, batch, self.workspace, self.use_kernel)

    def step(self):
        sampled = super().step()
        self.counters.generation_tokens += len(sampled)
        return sampled

    def stats(self) -> EngineStats:
        return self.counters.stats(self.scheduler)
