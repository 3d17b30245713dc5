"""Which tokens of a prompt each context-parallel rank holds, and how much causal work that is.

A causal prefill of T tokens is a triangle of (query, key) pairs: query i looks at keys 0..i.
Cut the prompt into cp contiguous pieces and the last rank holds the bottom rows of the
triangle, the ones that see the most keys, while rank 0 holds the top rows that see almost
none:

    contiguous, cp = 2                      zigzag, cp = 2 (4 chunks: rank r holds r and 2cp-1-r)
    keys ->                                 keys ->
    q  #                  rank 0:  1/4      q  #                  chunk 0  rank 0
    |  ##                 of the pairs      |  ##                 chunk 1  rank 1
    v  ###                                  v  ###                chunk 2  rank 1
       ####               rank 1:  3/4         ####               chunk 3  rank 0
       #####                                   #####
       ######                                  ######             each rank: one short-row chunk
       #######                                 #######            + one long-row chunk = ~1/2
       ########                                ########

Zigzag (as in Megatron-LM's context parallelism and zigzag ring attention) cuts the prompt into
2*cp chunks and gives rank r chunks r and 2cp-1-r: a chunk near the top paired with its mirror
near the bottom, so every rank gets the same number of pairs (exactly, when T is a multiple of
2*cp). The last token always lands on rank 0 (chunk 2cp-1), which is where the engine samples.

T need not be a multiple: chunk sizes differ by at most one token (the first T % n chunks get
the extra one). Every chunk must hold at least one token, so a prompt needs T >= 2*cp.
"""
from __future__ import annotations

from dataclasses import dataclass

Chunk = tuple[int, int]   # positions start .. end - 1 of the prompt


def split_even(T: int, n: int) -> list[Chunk]:
    """n contiguous chunks covering 0..T-1, sizes differing by at most one."""
    if n < 1 or T < n:
        raise ValueError(f"cannot cut {T} tokens into {n} non-empty chunks")
    base, extra = divmod(T, n)
    chunks, start = [], 0
    for i in range(n):
        end = start + base + (i < extra)
        chunks.append((start, end))
        start = end
    return chunks


@dataclass(frozen=True)
class Layout:
    """Each rank's chunks of a T-token prompt, in position order. `chunks` is the whole
    partition (every rank's chunks are taken from it, so two chunks are equal or disjoint)."""
    T: int
    cp: int
    zigzag: bool
    chunks: tuple[Chunk, ...]
    owned: tuple[tuple[Chunk, ...], ...]     # owned[r]: rank r's chunks

    def positions(self, rank: int) -> list[int]:
        return [p for a, b in self.owned[rank] for p in range(a, b)]

    def num_tokens(self, rank: int) -> int:
        return sum(b - a for a, b in self.owned[rank])

    def rank_of_last_token(self) -> int:
        return next(r for r, cs in enumerate(self.owned) if any(b == self.T for _, b in cs))


def make_layout(T: int, cp: int, zigzag: bool = True) -> Layout:
    """Zigzag: 2*cp chunks, rank r holds chunks r and 2cp-1-r. Otherwise cp contiguous pieces."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context_parallel_size must be an int >= 1, got {cp!r}")
    n = 2 * cp if zigzag else cp
    if T < n:
        raise ValueError(f"a prompt of {T} tokens cannot be split over {n} chunks "
                         f"({'zigzag: 2 per rank' if zigzag else '1 per rank'}); it needs T >= {n}")
    chunks = split_even(T, n)
    owned = [(chunks[r], chunks[n - 1 - r]) if zigzag else (chunks[r],) for r in range(cp)]
    return Layout(T, cp, zigzag, tuple(chunks), tuple(owned))


def relation(q: Chunk, k: Chunk) -> str:
    """How a query chunk sees a key chunk of the same partition under the causal mask."""
    if q == k:
        return "causal"             # the diagonal: query i sees keys up to i
    if k[1] <= q[0]:
        return "full"               # every key is before every query
    return "none"                   # every key is after every query: skipped, not masked


def pairs(q: Chunk, k: Chunk) -> int:
    """(query, key) score elements computed for this chunk pair (per head)."""
    n = q[1] - q[0]
    rel = relation(q, k)
    return n * (n + 1) // 2 if rel == "causal" else n * (k[1] - k[0]) if rel == "full" else 0


def work_per_rank(layout: Layout) -> list[int]:
    """Score elements each rank computes (its queries against every key they may see)."""
    return [sum(pairs(q, k) for q in layout.owned[r] for k in layout.chunks) for r in range(layout.cp)]


def imbalance(work: list[int]) -> float:
    """max / mean: how long the slowest rank takes relative to a perfect split (1.0 = even)."""
    return max(work) / (sum(work) / len(work))
