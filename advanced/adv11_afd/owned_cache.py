"""Lesson 13's prefix cache at 2:1: one block-id space, one cache per attention rank.

One block manager (rank 0's) hands out the block ids of every sequence; the block's K/V lives in
the pool of the sequence's attention rank (`owner`). A cached block can only serve a sequence of
the same rank, since the other rank's pool holds nothing at that id. So each rank gets its own
hash -> block map, and the block manager switches to the right one around each look-up:

    rank 0's sequences   hash chain -> caches[0] -> block ids whose K/V is in rank 0's pool
    the peer's           hash chain -> caches[1] -> block ids whose K/V is in the peer's pool

Everything else is lesson 13's: the chained hashes, the LRU free list, eviction. Two ranks that
see the same prompt each compute and cache it once, as two separate engines would.
"""
from __future__ import annotations

from step09_continuous_batching.sequence import Sequence
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from advanced.adv11_afd.microbatch import owner


class OwnedPrefixBlockManager(PrefixCachingBlockManager):
    def __init__(self, num_blocks: int, block_size: int, n_attention: int = 2):
        super().__init__(num_blocks, block_size)
        self.caches: list[dict[int, int]] = [self.cached] + [{} for _ in range(n_attention - 1)]
        self.rank_of_block: dict[int, int] = {}         # a cached block -> the rank whose map names it

    def _take_free_block(self) -> int:
        """Evicting a cached block removes its hash from the map of the rank that cached it."""
        block_id = next(iter(self.free_block_ids))
        current = self.cached
        self.cached = self.caches[self.rank_of_block.pop(block_id, 0)]
        try:
            return super()._take_free_block()
        finally:
            self.cached = current

    def match_prefix(self, seq: Sequence) -> int:
        self.cached = self.caches[owner(seq.seq_id, len(self.caches))]
        return super().match_prefix(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        rank = owner(seq.seq_id, len(self.caches))
        self.cached = self.caches[rank]
        super().cache_full_blocks(seq)
        for block_id in seq.block_table or []:          # every block of its table is its rank's
            if block_id in self.hash_of:
                self.rank_of_block.setdefault(block_id, rank)
