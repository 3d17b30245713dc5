"""Prefix caching for the hybrid: lesson 13's block hashes plus a state checkpoint per boundary.

A hit on a cached prefix of k blocks may resume at token k * block_size only if the DeltaNet
layers' state after exactly that token is kept. So:

    after a step   a sequence whose computed tokens end on a block boundary has its state
                   copied from its slot to a checkpoint slot, named by that block's hash
                   (lesson 13's chained hash: equal hash => equal prefix)
    admission      lesson 13's match, cut back to the longest matched block whose hash has a
                   checkpoint; that checkpoint is copied into the sequence's slot
    prompt chunks  are cut at the end of the KV match (where this request parts from a cached
                   one: the next request sharing that prefix finds a checkpoint there) and at
                   the prompt's last block boundary (`room`), so that both boundaries end a
                   step and get a checkpoint even when the prompt arrives whole

Checkpoints live in a StatePool of their own with a fixed number of slots, reused least
recently used first. The copies are queued by the scheduler and made by the engine before the
next forward (saves first: a slot just given to a new sequence still holds the old state until
a forward writes it). A checkpoint costs a whole state; the README puts numbers on that.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from torch import nn

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from advanced.adv13_linear_attention.engine import HybridEngine, HybridScheduler, build_hybrid_engine
from advanced.adv13_linear_attention.state_pool import StatePool


class StateCheckpoints:
    """Bookkeeping: block hash -> checkpoint slot (LRU), and the copies still to make."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"need at least one checkpoint slot, got {capacity}")
        self.capacity = capacity
        self.slot_of_hash: OrderedDict[int, int] = OrderedDict()
        self.free_slots: deque[int] = deque(range(capacity))
        self.saves: list[tuple[int, int]] = []       # (sequence slot, checkpoint slot)
        self.restores: list[tuple[int, int]] = []    # (checkpoint slot, sequence slot)
        self.num_saved = self.num_restored = 0

    def has(self, block_hash: int) -> bool:
        return block_hash in self.slot_of_hash

    def queue_save(self, block_hash: int, seq_slot: int) -> None:
        if block_hash in self.slot_of_hash:          # an equal prefix is already kept
            self.slot_of_hash.move_to_end(block_hash)
            return
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:                                        # evict the least recently used checkpoint
            _, slot = self.slot_of_hash.popitem(last=False)
        self.slot_of_hash[block_hash] = slot
        self.saves.append((seq_slot, slot))
        self.num_saved += 1

    def queue_restore(self, block_hash: int, seq_slot: int) -> None:
        self.slot_of_hash.move_to_end(block_hash)
        self.restores.append((self.slot_of_hash[block_hash], seq_slot))
        self.num_restored += 1

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        saves, restores, self.saves, self.restores = self.saves, self.restores, [], []
        return saves, restores


class CheckpointedBlockManager(PrefixCachingBlockManager):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.junction: dict[int, int] = {}           # seq id -> tokens its KV match covered

    def free(self, seq: Sequence) -> None:
        self.junction.pop(seq.seq_id, None)
        super().free(seq)

    def match_prefix(self, seq: Sequence, has_state: Callable[[int], bool] = lambda h: False) -> int:
        """Lesson 13's match, then give back the matched blocks past the last one with a state.
        Where the KV match ended is kept (`junction`): the scheduler ends a chunk there."""
        hit = super().match_prefix(seq)
        self.junction[seq.seq_id] = hit
        hashes, table = self.seq_hashes[seq.seq_id], seq.block_table
        while hashes and not has_state(hashes[-1]):
            hashes.pop()
            block = self.blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block.block_id] = None    # still cached, free again
            hit -= self.block_size
            self.hit_tokens -= self.block_size
        seq.num_computed_tokens = hit
        return hit


class StatePrefixScheduler(HybridScheduler):
    block_manager: CheckpointedBlockManager

    def __init__(self, config: PagedSchedulerConfig, block_manager: CheckpointedBlockManager,
                 checkpoints: int = 64):
        super().__init__(config, block_manager)
        self.checkpoints = StateCheckpoints(checkpoints)

    def admit(self, seq: Sequence) -> None:
        super().admit(seq)
        if not seq.block_table and self.block_manager.match_prefix(seq, self.checkpoints.has):
            self.checkpoints.queue_restore(self.block_manager.seq_hashes[seq.seq_id][-1],
                                           self.slots.slot_of[seq.seq_id])

    def room(self, seq: Sequence) -> int:
        """Lesson 12's room, but a prompt chunk stops at the junction and at the prompt's last
        block boundary."""
        room, bm, start = super().room(seq), self.block_manager, seq.num_computed_tokens
        last = (seq.num_prompt_tokens - 1) // bm.block_size * bm.block_size
        for stop in (bm.junction.get(seq.seq_id, 0), last):
            if start < stop:
                return min(room, stop - start)
        return room

    def after_step(self, batch: ScheduledBatch) -> None:
        bs = self.block_manager.block_size
        for seq in batch.seqs:
            if seq.block_table is None:
                continue
            self.block_manager.cache_full_blocks(seq)
            c = seq.num_computed_tokens
            if c and c % bs == 0:
                self.checkpoints.queue_save(self.block_manager.seq_hashes[seq.seq_id][c // bs - 1],
                                            self.slots.slot_of[seq.seq_id])


def copy_slots(src: StatePool, dst: StatePool, pairs: list[tuple[int, int]]) -> None:
    """dst slot := src slot for every (src, dst) pair, conv and delta states of every layer, in order."""
    for s, d in pairs:
        for a, b in zip(src.conv + src.delta, dst.conv + dst.delta):
            b[d].copy_(a[s])


class StatePrefixEngine(HybridEngine):
    def __init__(self, *args, checkpoint_pool: StatePool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler, StatePrefixScheduler) or checkpoint_pool is None:
            raise TypeError("StatePrefixEngine needs a StatePrefixScheduler and a checkpoint_pool: "
                            "build it with build_state_prefix_engine")
        self.checkpoint_pool = checkpoint_pool

    def prepare_kv(self, batch: ScheduledBatch) -> None:
        super().prepare_kv(batch)
        saves, restores = self.scheduler.checkpoints.take()
        copy_slots(self.state_pool, self.checkpoint_pool, saves)
        copy_slots(self.checkpoint_pool, self.state_pool, restores)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoints held at this point."""
        return len(self.scheduler.checkpoints.slot_of_hash) * self.checkpoint_pool.bytes_per_slot


def build_state_prefix_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, checkpoints: int = 64,
                              attention_backend: str = "auto") -> StatePrefixEngine:
    """build_hybrid_engine's parts with lesson 13's hashed blocks and `checkpoints` state checkpoints."""
    engine = build_hybrid_engine(model, config, attention_backend)
    scheduler = StatePrefixScheduler(engine.scheduler.config, CheckpointedBlockManager(
        engine.kv_pool.num_blocks, engine.kv_pool.block_size), checkpoints)
    weight = model.model.embed_tokens.weight
    return StatePrefixEngine(model, scheduler, engine.kv_pool, engine.attention, engine.runner, state_pool=engine.state_pool,
                             checkpoint_pool=StatePool(model.config, checkpoints, weight.dtype, weight.device))
