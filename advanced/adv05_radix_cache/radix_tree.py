"""A radix tree of token runs over the paged KV pool (SGLang's RadixAttention idea).

    root
     └─ [<sys> You are a helpful assistant ...]          blocks [7, 8, 9]
          ├─ [What is the capital of France?...]          blocks [9', 12]
          └─ [Tell me a joke ...]                         blocks [9'', 30]

Every edge holds a run of tokens; the path from the root to a node spells a prefix, and the
node remembers the KV blocks that hold its tokens. A node covers positions [start, end) of
every sequence that goes through it, so its blocks are the ones of block indices
start // block_size .. (end - 1) // block_size. Runs need not end on a block boundary: a
block can be shared by a parent and its child (the child continued writing into it), or the
child can have its own copy of that block (block 9' above), which then holds the parent's
last tokens as well as the child's first ones. Matching therefore takes, for each block
index, the block of the DEEPEST node on the path: it holds every token of the match there.

The tree only stores block ids; who holds a block (sequences, the tree) is counted by the
block manager. `refs[b]` is how many nodes list block b, `claim[b]` how many leading slots
of block b the tree relies on: a sequence that wants to write slot o of block b must not
do it in place if claim[b] > o (block_manager.py copies the block first).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]                # the run of tokens on the edge into this node
    start: int                             # position of tokens[0] in every sequence through here
    blocks: list[int]                      # one block id per block index the run touches
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)   # keyed by the child's first token
    last_access: int = 0                   # a tick of the tree's clock, for LRU eviction

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Match:
    num_tokens: int                        # length of the longest cached prefix
    block_ids: list[int]                   # a block table for it: ceil(num_tokens / block_size) ids


def common_length(a: tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixTree:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = Node((), 0, [])
        self.refs: dict[int, int] = {}     # block id -> number of nodes that list it
        self.claim: dict[int, int] = {}    # block id -> leading slots the tree relies on
        self._clock = itertools.count(1)

    # ---- lookup ------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int] | tuple[int, ...]) -> Match:
        """The longest prefix of `tokens` that the tree holds, at token granularity."""
        bs, now = self.block_size, next(self._clock)
        node, n, table = self.root, 0, []
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                break
            k = common_length(child.tokens, tokens[n:n + len(child.tokens)])
            child.last_access = now
            first = child.start // bs
            for j in range(n // bs, (n + k - 1) // bs + 1):
                block = child.blocks[j - first]
                if j < len(table):
                    table[j] = block       # the deeper node's copy of a shared boundary block
                else:
                    table.append(block)
            n += k
            if k < len(child.tokens):
                break
            node = child
        return Match(n, table)

    # ---- insertion ---------------------------------------------------------------------------
    def insert(self, tokens: list[int], block_ids: list[int]) -> None:
        """Remember that `block_ids` (a block table) hold the K/V of `tokens`.

        Prefixes the tree already has keep their blocks (the first to insert wins); only the
        part past the longest match becomes a new leaf, with the caller's blocks.
        """
        bs, now = self.block_size, next(self._clock)
        if len(block_ids) < -(-len(tokens) // bs):
            raise ValueError(f"block_ids: {len(block_ids)} blocks cannot hold {len(tokens)} tokens")
        node, n = self.root, 0
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                leaf = Node(tuple(tokens[n:]), n, list(block_ids[n // bs:(len(tokens) - 1) // bs + 1]), node)
                leaf.last_access = now
                node.children[tokens[n]] = leaf
                self._hold(leaf)
                return
            k = common_length(child.tokens, tokens[n:n + len(child.tokens)])
            child.last_access = now
            if n + k == len(tokens):            # all known already (maybe inside a run): done
                return
            if k < len(child.tokens):           # diverges inside the run: cut it there
                self._split(child, k)
            n += k
            node = child

    def _split(self, node: Node, k: int) -> None:
        """Cut node's run after k tokens: node keeps the head, a new child takes the tail."""
        bs = self.block_size
        first = node.start // bs
        cut = node.start + k
        tail = Node(node.tokens[k:], cut, node.blocks[cut // bs - first:], node,
                    node.children, node.last_access)
        for c in tail.children.values():
            c.parent = tail
        node.tokens, node.children = node.tokens[:k], {tail.tokens[0]: tail}
        node.blocks = node.blocks[:(cut - 1) // bs - first + 1]
        if cut % bs:                        # the block at the cut is now listed by both
            self.refs[tail.blocks[0]] += 1

    def _hold(self, node: Node) -> None:
        bs = self.block_size
        first = node.start // bs
        for i, b in enumerate(node.blocks):
            self.refs[b] = self.refs.get(b, 0) + 1
            j = first + i
            self.claim[b] = max(self.claim.get(b, 0), min(node.end, (j + 1) * bs) - j * bs)

    # ---- eviction ----------------------------------------------------------------------------
    def leaves(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def remove_leaf(self, node: Node) -> list[int]:
        """Drop a leaf; return the blocks no node lists any more."""
        if node.children or node.parent is None:
            raise ValueError("node: only a leaf below the root can be removed")
        del node.parent.children[node.tokens[0]]
        released = []
        for b in node.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b], self.claim[b]
                released.append(b)
        # claim[b] of a block the parent still lists stays a high-water mark: at worst a
        # later writer copies a block it could have written in place, never the reverse.
        return released

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
