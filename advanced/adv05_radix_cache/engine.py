"""Lesson 13's scheduler and lesson 15's engine with the radix block manager plugged in.

What changes against lesson 13:
  - admission is the same call (match_prefix), but the match may end inside a block;
  - tokens enter the cache by insertion into the tree: after each prompt chunk, when a
    decode fills a block, and when a sequence finishes or is preempted (lesson 13 named
    full blocks only, so the last partial block of every request was lost);
  - before each forward the engine makes the copy-on-write copies the block manager queued;
  - `fork(seq)` starts a second sequence on the same K/V (parallel sampling, a branch of a
    conversation), sharing every block until one of them writes into a shared one.
The forward, the pool and the attention backends are untouched. RadixEngine is lesson 15's
Engine with the mixin; `build_radix_engine` has lesson 16's build_engine (either part) give it the
radix scheduler and block manager as parts.
"""
from __future__ import annotations

from torch import nn

from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence, SequenceStatus
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingScheduler
from step15_flash_attention.engine import Engine
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.cpu import engine as fast_path_engine
from advanced.adv05_radix_cache.block_manager import RadixBlockManager


def copy_blocks(pool: KVPool, copies: list[tuple[int, int]]) -> None:
    """pool block dst := pool block src, for K and V of every layer, in the given order.

    Every pool layout of lessons 12-16 puts the block first ([num_blocks, ...]), so one
    indexed copy per layer moves a whole block. In order, not batched: a block freed by one
    copy's source may be the next copy's destination.
    """
    for src, dst in copies:
        for cache in pool.k + pool.v:
            cache[dst].copy_(cache[src])


class RadixScheduler(PrefixCachingScheduler):
    block_manager: RadixBlockManager

    def check_admissible(self, seq: Sequence) -> None:
        super().check_admissible(seq)
        bm = self.block_manager
        need = bm.blocks_for(seq.num_prompt_tokens + seq.params.max_tokens - 1) + 1
        if need > bm.num_blocks:            # + 1: a shared block is copied before its source is let go
            raise ValueError(f"request needs up to {need} KV blocks (one more than its tokens, for a "
                             f"copy-on-write) but the pool has {bm.num_blocks}: it could never finish")

    def after_step(self, batch: ScheduledBatch) -> None:
        bs = self.block_manager.block_size
        for seq in batch.seqs:
            # Prompt chunks at once (the next arrival may share them); decodes block by block.
            c = seq.num_computed_tokens
            if seq.block_table is not None and (c <= seq.num_prompt_tokens or c % bs == 0):
                self.block_manager.cache_sequence(seq)

    def release(self, seq: Sequence, scheduled: int) -> None:
        self.block_manager.cache_sequence(seq)      # preempted: its K/V stay cached until evicted
        super().release(seq, scheduled)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.cache_sequence(seq)      # the whole conversation, partial block too
        super().finish(seq, reason)


class RadixCacheMixin:
    """Put in front of lesson 15's Engine: `class RadixEngine(RadixCacheMixin, Engine)`. Its
    scheduler must be a RadixScheduler over a RadixBlockManager (build_radix_engine gives it both)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not (isinstance(self.scheduler, RadixScheduler) and isinstance(self.scheduler.block_manager, RadixBlockManager)):
            raise TypeError(f"the radix cache needs a RadixScheduler over a RadixBlockManager, got "
                            f"{type(self.scheduler).__name__} over {type(self.scheduler.block_manager).__name__}: "
                            f"build the engine with build_radix_engine")

    def prepare_kv(self, batch: ScheduledBatch) -> None:
        super().prepare_kv(batch)
        copy_blocks(self.kv_pool, self.scheduler.block_manager.take_copies())

    def fork(self, parent: Sequence, params: SamplingParams | None = None,
             next_token: int | None = None) -> Sequence:
        """A new running sequence with parent's tokens and K/V, sharing its blocks.

        The parent must be decoding (its prompt computed, one sampled token not yet fed back).
        `next_token` replaces that last token in the child: a different continuation.
        """
        s = self.scheduler
        if parent.status is not SequenceStatus.RUNNING or parent.num_uncomputed_tokens != 1:
            raise ValueError("parent: fork a running sequence between steps, once its prompt is computed")
        if len(s.running) >= s.config.max_num_seqs:
            raise RuntimeError(f"max_num_seqs={s.config.max_num_seqs} sequences already running")
        if next_token is not None and not 0 <= next_token < self.model.config.vocab_size:
            raise ValueError(f"next_token must be in [0, {self.model.config.vocab_size}), got {next_token}")
        child = Sequence(parent.prompt_token_ids, params or parent.params)
        child.token_ids = list(parent.token_ids)
        if next_token is not None:
            child.token_ids[-1] = next_token
        s.check_admissible(child)
        s.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        s.running.append(child)
        return child


class RadixEngine(RadixCacheMixin, Engine):
    """Lesson 15's engine with the radix cache; any runner (lessons 15-16)."""


def build_radix_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, fast_path: bool = True,
                       **options) -> RadixEngine:
    """Lesson 16's engine with its CPU fast path (fast_path=False: graph capture only) with the
    radix cache. options: that build_engine's options (use_graph=False: eager steps; with
    fast_path=False also pack_weights=False)."""
    if not isinstance(fast_path, bool):
        raise TypeError(f"fast_path must be True or False, got {fast_path!r}")
    build = fast_path_engine.build_engine if fast_path else lesson16.build_engine
    return build(model, config, engine_class=RadixEngine, scheduler_class=RadixScheduler,
                            block_manager_class=RadixBlockManager, **options)
