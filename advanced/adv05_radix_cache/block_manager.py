"""Lesson 12's block manager with a radix tree as its prefix cache, and copy-on-write.

A block is in exactly one of three states:

    free        ref_count 0, no tree node lists it        on free_block_ids (contents garbage)
    cached      ref_count 0, listed by the tree           in `evictable`: counts as free room,
                                                          handed out after its leaf is evicted
    referenced  ref_count > 0 (in some sequence's table)  never evicted

ref_count counts sequences' block tables only (as in lessons 12-13); the tree keeps its own
count (RadixTree.refs). Lesson 13 matched whole blocks; here a match may end in the middle of
a block. A sequence that then writes into that block must not do it in place when someone
else relies on the slots it would overwrite: another sequence holds the block
(ref_count > 1), or the tree holds tokens there (claim > offset). It first takes a private
copy (copy-on-write): the block manager queues (src, dst) and the engine copies the K/V in
the pool before the step's forward writes anything (engine.py).
"""
from __future__ import annotations

from advanced.adv05_radix_cache.radix_tree import Node, RadixTree
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.block_manager import BlockManager


class RadixBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.tree = RadixTree(block_size)
        self.evictable: set[int] = set()            # cached blocks: ref_count 0, held by the tree
        self.pending_copies: list[tuple[int, int]] = []   # (src, dst) for the engine, in order
        self.query_tokens = self.hit_tokens = 0     # the counters lesson 14's stats() reads
        self.num_copies = self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)   # cached blocks are room too

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.query_tokens)

    # ---- reference counts: every change goes through these two -------------------------------
    def _add_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.discard(block_id)        # taken back from the cache: in use again
        block.ref_count += 1

    def _drop_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block_id in self.tree.refs:
                self.evictable.add(block_id)        # keeps its K/V for a later match
            else:
                self.free_block_ids.append(block_id)

    # ---- eviction ----------------------------------------------------------------------------
    def _frees_a_block(self, leaf: Node) -> bool:
        return any(self.tree.refs[b] == 1 and self.blocks[b].ref_count == 0 for b in leaf.blocks)

    def evict(self, num_blocks: int) -> int:
        """Evict least recently used leaves until `num_blocks` blocks are free (or the cache is
        empty); return how many blocks became free."""
        freed = 0
        while len(self.free_block_ids) < num_blocks and self.evictable:
            leaves = self.tree.leaves()
            # A leaf whose blocks all serve running sequences frees nothing: take it only when
            # no other leaf is left (its sequences insert their tokens again when they end).
            useful = [leaf for leaf in leaves if self._frees_a_block(leaf)] or leaves
            for b in self.tree.remove_leaf(min(useful, key=lambda n: n.last_access)):
                if self.blocks[b].ref_count == 0:   # referenced blocks are never taken
                    self.evictable.remove(b)
                    self.free_block_ids.append(b)
                    freed += 1
        self.num_evicted_blocks += freed
        return freed

    def _take_free_block(self) -> int:
        if not self.free_block_ids and self.evict(1) == 0:
            raise RuntimeError("out of KV blocks: none free and none cached")
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0 and block_id not in self.tree.refs, f"block {block_id} still held"
        block.ref_count = 1
        return block_id

    # ---- the interface the scheduler calls ---------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """On admission: share the longest cached prefix (any length); return tokens reused.

        The last token is always left to compute: its logits are what we sample from.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        match = self.tree.match_prefix(seq.token_ids[:seq.num_tokens - 1])
        for b in match.block_ids:
            self._add_ref(b)
        seq.block_table = match.block_ids
        seq.num_computed_tokens = match.num_tokens
        self.query_tokens += seq.num_tokens
        self.hit_tokens += match.num_tokens
        return match.num_tokens

    def needs_copy(self, seq: Sequence) -> bool:
        """Would seq's next token land in a block that others rely on?"""
        offset = seq.num_computed_tokens % self.block_size
        if offset == 0 or not seq.block_table:
            return False                            # the next token starts a fresh block
        b = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.blocks[b].ref_count > 1 or self.tree.claim.get(b, 0) > offset

    def room(self, seq: Sequence) -> int:
        tail = len(self.table(seq)) * self.block_size - seq.num_computed_tokens
        free = self.num_free_blocks
        if self.needs_copy(seq):                    # the tail is usable only in a copy
            return tail + (free - 1) * self.block_size if free else 0
        return tail + free * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        table = self.table(seq)
        need = self.blocks_for(num_tokens) - len(table)
        copy = num_tokens > seq.num_computed_tokens and self.needs_copy(seq)
        if need + copy > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need + copy}, {self.num_free_blocks} free")
        if copy:
            self._copy_on_write(seq)
        for _ in range(need):
            table.append(self._take_free_block())

    def _copy_on_write(self, seq: Sequence) -> None:
        j = seq.num_computed_tokens // self.block_size
        src = seq.block_table[j]
        dst = self._take_free_block()               # seq still holds src: it cannot be evicted
        self.pending_copies.append((src, dst))
        seq.block_table[j] = dst
        self._drop_ref(src)
        self.num_copies += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies the engine must make before this step's forward, in order."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_sequence(self, seq: Sequence) -> None:
        """Insert seq's computed tokens (and the blocks holding them) into the tree."""
        if seq.block_table and seq.num_computed_tokens:
            self.tree.insert(seq.token_ids[:seq.num_computed_tokens], seq.block_table)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's K/V (parallel sampling, a forked conversation); no copy yet."""
        if parent.block_table is None:
            raise ValueError("parent: it holds no KV blocks (waiting or finished)")
        if child.block_table:
            raise ValueError("child: it already holds KV blocks")
        n = parent.num_computed_tokens
        child.block_table = parent.block_table[:self.blocks_for(n)]
        for b in child.block_table:
            self._add_ref(b)
        child.num_computed_tokens = n

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table or []:
            self._drop_ref(b)
        seq.block_table = None
