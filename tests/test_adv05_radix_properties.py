"""Advanced lesson 05, properties: thousands of random operations on the radix block manager
(admit, match, write, fork, finish, evict), each checked against a model of what every pool slot
holds: no sequence ever reads a K/V it did not compute, and nothing leaks."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from advanced.adv05_radix_cache.block_manager import RadixBlockManager
from step09_continuous_batching.sequence import Sequence
from step06_sampler.params import SamplingParams


# ---- a model of the pool: each slot holds a name of the prefix whose K/V it would hold ---------
def prefix_names(tokens: list[int]) -> list[int]:
    """names[p] identifies tokens[:p + 1] (K/V at position p depend on exactly that)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class Pool:
    def __init__(self, bm: RadixBlockManager):
        self.bm, self.bs = bm, bm.block_size
        self.slots = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def copy(self) -> None:                                # what RadixCacheMixin.prepare_kv does
        for src, dst in self.bm.take_copies():
            self.slots[dst] = list(self.slots[src])

    def write(self, seq: Sequence, start: int, end: int) -> None:   # what the forward does
        names = prefix_names(seq.token_ids[:end])
        for p in range(start, end):
            self.slots[seq.block_table[p // self.bs]][p % self.bs] = names[p]

    def holds(self, table: list[int], tokens: list[int]) -> bool:
        names = prefix_names(tokens)
        return all(self.slots[table[p // self.bs]][p % self.bs] == names[p] for p in range(len(tokens)))


def check(bm: RadixBlockManager, pool: Pool, running: list[Sequence]) -> None:
    refs = Counter(b for s in running for b in s.block_table or [])
    assert [b.ref_count for b in bm.blocks] == [refs[i] for i in range(bm.num_blocks)]    # exact
    nodes = bm.tree.nodes()
    assert Counter(b for n in nodes for b in n.blocks) == Counter(bm.tree.refs)
    free = list(bm.free_block_ids)
    assert len(set(free)) == len(free)
    referenced = {i for i in range(bm.num_blocks) if refs[i]}
    cached = set(bm.tree.refs) - referenced
    assert not set(free) & (referenced | set(bm.tree.refs))         # a free block is nobody's
    assert bm.evictable == cached
    assert len(free) + len(referenced) + len(cached) == bm.num_blocks   # no leaks
    for s in running:                                  # nobody overwrote a running sequence's K/V
        assert pool.holds(s.block_table, s.token_ids[:s.num_computed_tokens])
    bs = bm.block_size
    for n in nodes:                                    # every node's blocks hold its whole path
        assert n.start == n.parent.end and n.parent.children[n.tokens[0]] is n
        assert len(n.blocks) == (n.end - 1) // bs - n.start // bs + 1
        path, node = [], n
        while node.parent is not None:
            path[:0], node = list(node.tokens), node.parent
        names = prefix_names(path)
        first = n.start // bs
        for p in range(first * bs, n.end):
            assert pool.slots[n.blocks[p // bs - first]][p % bs] == names[p]


def longest_in_tree(bm: RadixBlockManager, query: list[int]) -> int:
    best = 0
    for n in bm.tree.nodes():
        path, node = [], n
        while node.parent is not None:
            path[:0], node = list(node.tokens), node.parent
        k = 0
        while k < min(len(path), len(query)) and path[k] == query[k]:
            k += 1
        best = max(best, k)
    return best


def run_ops(data, n_ops: int) -> int:
    bm = RadixBlockManager(data.draw(st.integers(4, 24)), data.draw(st.sampled_from([1, 2, 3, 4])))
    pool, running, waiting = Pool(bm), [], []
    tok = st.integers(1, 2)                                # a tiny vocabulary: prefixes repeat
    hits = 0

    def admit(seq: Sequence, step: list, matched: list) -> None:
        nonlocal hits
        got = bm.match_prefix(seq)
        hits += got
        matched.append((seq, list(seq.block_table), got))
        if bm.room(seq) >= seq.num_uncomputed_tokens:
            bm.allocate(seq, seq.num_tokens)
            running.append(seq)
            step.append(seq)
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0

    for _ in range(n_ops):
        op = data.draw(st.sampled_from(["new", "step", "step", "fork", "finish", "preempt", "match", "evict"]))
        if op in ("new", "step"):
            # One engine step: grow some running sequences, maybe preempt one, maybe admit one;
            # then the copies, then every write, as the engine orders them.
            step: list[Sequence] = []
            matched: list[tuple[Sequence, list[int], int]] = []
            if op == "step" and running:
                for seq in data.draw(st.lists(st.sampled_from(running), max_size=3, unique=True)):
                    k = data.draw(st.integers(1, 6))
                    if bm.room(seq) >= k:
                        seq.token_ids += [data.draw(tok) for _ in range(k)]
                        bm.allocate(seq, seq.num_tokens)
                        step.append(seq)
                if step and data.draw(st.booleans()):      # a victim, maybe one granted already
                    victim = data.draw(st.sampled_from(running))
                    running.remove(victim)
                    if victim in step:
                        step.remove(victim)
                        del victim.token_ids[victim.num_computed_tokens:]
                    bm.cache_sequence(victim)
                    bm.free(victim)
                    victim.num_computed_tokens = 0
                    waiting.append(victim)
            if op == "new" or data.draw(st.booleans()):
                if waiting and data.draw(st.booleans()):
                    admit(waiting.pop(0), step, matched)
                else:
                    admit(Sequence([data.draw(tok) for _ in range(data.draw(st.integers(1, 20)))],
                                   SamplingParams(max_tokens=64)), step, matched)
            pool.copy()
            for seq, table, got in matched:                # a match never returns other tokens
                assert pool.holds(table, seq.token_ids[:got])
            for seq in step:
                pool.write(seq, seq.num_computed_tokens, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                if data.draw(st.booleans()):
                    bm.cache_sequence(seq)
        elif op == "fork" and running:
            parent = data.draw(st.sampled_from(running))
            child = Sequence(parent.prompt_token_ids, parent.params)
            child.token_ids = list(parent.token_ids)
            bm.fork(parent, child)
            running.append(child)
        elif op in ("finish", "preempt") and running:
            seq = running.pop(data.draw(st.integers(0, len(running) - 1)))
            bm.cache_sequence(seq)
            bm.free(seq)
            seq.num_computed_tokens = 0
            if op == "preempt":
                waiting.append(seq)
        elif op == "match":
            query = [data.draw(tok) for _ in range(data.draw(st.integers(0, 24)))]
            m = bm.tree.match_prefix(query)
            assert m.num_tokens == longest_in_tree(bm, query) and len(m.block_ids) == bm.blocks_for(m.num_tokens)
            assert pool.holds(m.block_ids, query[:m.num_tokens])
        elif op == "evict":
            before = len(bm.free_block_ids)
            bm.evict(before + data.draw(st.integers(1, 4)))
        check(bm, pool, running)
    assert bm.hit_tokens == hits
    for seq in running:
        bm.free(seq)
    bm.evict(bm.num_blocks)
    assert len(bm.free_block_ids) == bm.num_blocks and not bm.tree.nodes()
    return bm.num_copies


@pytest.mark.slow          # ~7 s: CI runs it (make test-slow)
@settings(max_examples=50, deadline=None)
@given(st.data())
def test_block_manager_properties(data):
    # 50 examples x 220 operations = 11,000 random operations, checked after every one
    run_ops(data, 220)
