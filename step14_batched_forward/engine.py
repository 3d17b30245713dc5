"""Lesson 13's engine with the batched varlen step attention, and the counters a server needs."""
from __future__ import annotations

from dataclasses import dataclass

from step09_continuous_batching.scheduler import ScheduledBatch
from step13_prefix_cache.engine import PrefixCachingEngine
from step14_batched_forward import kernel
from step14_batched_forward.attention import VarlenPagedAttention, Workspace
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step14_batched_forward.packed_linear import pack_linears


@dataclass
class EngineStats:
    """A snapshot of what lesson 21 will serve as Prometheus metrics."""
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int     # prompt tokens looked up
    prefix_cache_hits: int        # of which found in the cache
    num_preemptions: int
    prompt_tokens: int            # prompt tokens computed (prefix hits excluded)
    generation_tokens: int


class BatchedEngine(PrefixCachingEngine):
    pool_class = HeadMajorKVPool

    def __init__(self, *args, pack_weights: bool = True, use_kernel: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_tokens = self.generation_tokens = 0
        self.workspace = Workspace()
        # Decodes go through the C++ paged kernel when it builds (else the torch gather path).
        self.use_kernel = use_kernel and kernel.load() is not None
        # Linears get their weights pre-packed for oneDNN, once (the model changes in place): bf16
        # where oneDNN computes bf16, float32 on x86 (packed_linear.py).
        self.num_packed = pack_linears(self.model) if pack_weights else 0

    def make_attention(self, batch: ScheduledBatch) -> VarlenPagedAttention:
        self.count_prompt_tokens(batch)
        return VarlenPagedAttention(self.kv_pool, batch, self.workspace, self.use_kernel)

    def count_prompt_tokens(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)

    def step(self):
        sampled = super().step()
        self.generation_tokens += len(sampled)
        return sampled

    def stats(self) -> EngineStats:
        s = self.scheduler
        bm = s.block_manager
        return EngineStats(len(s.running), len(s.waiting), s.num_used_blocks, bm.num_blocks,
                           bm.query_tokens, bm.hit_tokens, s.num_preemptions,
                           self.prompt_tokens, self.generation_tokens)
