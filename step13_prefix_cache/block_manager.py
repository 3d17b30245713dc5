"""A block manager that remembers what each full block holds, so equal prefixes share KV.

    request 1: [system prompt .................][question A]
                 block0    block1    block2      block3
    request 2: [system prompt .................][question B]
                 hit!      hit!      hit!        new block
A full block is named by a hash chained over every token up to its end:
hash_i = hash(hash_{i-1}, tokens of block i). Equal hash => equal prefix (we still compare the
tokens, in case two prefixes ever collide). Blocks are shared through reference counts; a block
nobody holds keeps its contents and its hash on the free list, and is handed out again on a
later hit, until it is the least recently freed block and someone needs a fresh one.
"""
from __future__ import annotations

from collections import OrderedDict

from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.block_manager import BlockManager


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class PrefixCachingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        # The free list becomes an LRU: the least recently freed block is reused (evicted) first.
        self.free_block_ids = OrderedDict((i, None) for i in range(num_blocks))  # type: ignore[assignment]
        self.hash_of: dict[int, int] = {}                  # block id -> hash of its contents
        self.tokens_of: dict[int, tuple[int, ...]] = {}
        self.cached: dict[int, int] = {}                   # hash -> block id
        self.seq_hashes: dict[int, list[int]] = {}         # seq id -> hashes of its full blocks
        self.query_tokens = self.hit_tokens = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        h = self.hash_of.pop(block_id, None)
        if h is not None:                                   # evict: its old contents are gone
            del self.cached[h]
            del self.tokens_of[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} still referenced"
        block.ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """On admission: take every cached full block of seq's prefix; return tokens reused.

        At least the last token is always left to compute: its logits are what we sample from.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        table, hashes, prev = self.table(seq), [], None
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.tokens_of[block_id] != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]           # back from the dead: no longer free
            block.ref_count += 1
            table.append(block_id)
            hashes.append(h)
            prev = h
        self.seq_hashes[seq.seq_id] = hashes
        hit = len(table) * bs
        self.query_tokens += seq.num_tokens
        self.hit_tokens += hit
        seq.num_computed_tokens = hit
        return hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: name every block that is now full of computed tokens."""
        bs = self.block_size
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        table = seq.block_table or []
        prev = hashes[-1] if hashes else None
        for i in range(len(hashes), min(seq.num_computed_tokens // bs, len(table))):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            prev = block_hash(prev, tokens)
            hashes.append(prev)
            block_id = table[i]
            if prev not in self.cached and block_id not in self.hash_of:
                self.cached[prev] = block_id
                self.hash_of[block_id] = prev
                self.tokens_of[block_id] = tokens
            # else: an equal block computed by someone else in the same step is already cached;
            # this copy stays private and simply returns to the pool when freed.

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table or []):             # tail first: evicted before the head
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = None
        self.seq_hashes.pop(seq.seq_id, None)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.query_tokens)
