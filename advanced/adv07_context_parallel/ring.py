r"""Ring attention: each rank attends its own queries to every rank's K/V, one block at a time.

Every rank holds the q, k, v of its own tokens (zigzag.py). Attention needs, for each query,
all the keys before it, and those are spread over all ranks. So the K/V blocks travel around a
ring, one hop per round, while each rank computes with the block it has in hand:

    round 0            round 1            round 2   (cp = 3; Bi = K/V of rank i's tokens)
    rank 0: B0 -\      rank 0: B2 -\      rank 0: B1
    rank 1: B1 --> +1  rank 1: B0 --> +1  rank 1: B2
    rank 2: B2 -/      rank 2: B1 -/      rank 2: B0
            compute with the block in hand, send it on to rank+1, receive the next from rank-1

cp rounds of compute, cp - 1 hops; a hop overlaps the round's compute (isend/irecv return at
once, gloo moves the bytes in its own threads). What each round yields for a query row is a
*partial* attention over some of its keys, with the row's log-sum-exp; partials merge exactly
(adv04's `merge_splits`, the flash-decoding merge): out = sum_s exp(lse_s - LSE) o_s.

Within a round, each (query chunk, key chunk) pair is one of three cases (zigzag.relation):
the diagonal (causal kernel), keys all before the queries (no mask), or all after (skipped).

Rank 0 also keeps every block that passes through it: after cp - 1 hops it has seen every
rank's K/V of this layer, which is exactly what its paged pool needs for the decode. The ring
delivers the prompt's KV cache to rank 0 at no extra bytes; a `kv_sink` writes it.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from advanced.adv04_flash_decoding.flash_decode_torch import merge_splits
from advanced.adv07_context_parallel.zigzag import Chunk, Layout, pairs, relation
from minivllm_support.timeline import Timeline
from step17_tensor_parallel.parallel import CollectiveError

KVSink = Callable[[int, int, Tensor], None]      # (layer, source rank, [2, n, Hkv, D]) -> None


def attend_chunk_math(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D], k/v [m, Hkv, D] -> out [n, Hq, D] float32, lse [n, Hq]. Plain softmax, to read."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:                                    # the diagonal chunk: query i sees keys 0..i
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)                         # [Hq, n]
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v)
    return out, lse.T


def attend_chunk(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """The same, through the CPU flash kernel behind torch's SDPA, called directly because it
    also returns the log-sum-exp (SDPA throws it away). Memory stays linear in the length."""
    if q.device.type != "cpu":
        return attend_chunk_math(q, k, v, causal, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, causal, scale=scale)
    return out[0].transpose(0, 1).float(), lse[0].T


class Ring:
    """This rank's two neighbours and the asynchronous hop between them."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout = rank, world, datetime.timedelta(seconds=timeout_s)
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world

    def start(self, send: Tensor, recv: Tensor) -> list:
        try:
            return [dist.isend(send, self.next), dist.irecv(recv, self.prev)]
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or DistError
            raise CollectiveError(f"ring hop from rank {self.rank} failed to start: {e}") from e

    def finish(self, works: list) -> None:
        try:
            for w in works:
                w.wait(self.timeout)      # a silent peer becomes an error, never a hang
        except Exception as e:  # noqa: BLE001
            raise CollectiveError(f"ring hop on rank {self.rank} failed: {e}") from e


def time_hops(ring: Ring, sizes: list[int], repeats: int) -> list[tuple[int, float]]:
    """Every rank runs this at once: bare ring hops of `sizes` bytes, no compute to hide behind.
    Returns (bytes, best seconds) per size: the link's cost, c + bytes / bandwidth."""
    out = []
    for n in sizes:
        send, recv = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            ring.finish(ring.start(send, recv))
            best = min(best, time.perf_counter() - t0)
        out.append((n, best))
    return out


@dataclass
class RingStats:
    """What one rank did in one prefill: the README's bytes and balance figures come from here."""
    pairs: int = 0                 # score elements (per head) this rank computed
    bytes_sent: int = 0
    bytes_per_layer: int = 0
    attention_s: float = 0.0
    wait_s: float = 0.0
    rounds: list = field(default_factory=list)    # (layer, round, pairs, seconds)


class RingAttention:
    """The step attention (lesson 04's `attn(layer_idx, q, k, v)`) of one rank for one prompt.

    q/k/v hold this rank's tokens in position order (its chunks one after the other). `ring`
    is None when cp == 1. Spans go to `timeline`: the linears between two attention calls,
    each round's attention, each wait for a hop.
    """

    def __init__(self, layout: Layout, rank: int, ring: Ring | None, timeline: Timeline | None = None,
                 kv_sink: KVSink | None = None, scale: float | None = None):
        self.layout, self.rank, self.ring, self.kv_sink, self.scale = layout, rank, ring, kv_sink, scale
        self.tl = timeline or Timeline(rank, enabled=False)
        self.stats = RingStats()
        rows, off = {}, 0
        for c in layout.owned[rank]:
            rows[c] = slice(off, off + c[1] - c[0])
            off += c[1] - c[0]
        self.rows = rows                             # my chunk -> my rows
        self.last_end = time.perf_counter_ns()       # end of the previous attention call
        self.hook: Callable[[int], None] | None = None   # called first at each layer (fault tests)

    def mark_linears(self, layer: int) -> None:
        """Everything since the last attention call was this rank's local work: norms, q/k/v,
        o_proj and MLP of its own tokens. Called at each attention call and once at the end."""
        now = time.perf_counter_ns()
        self.tl.add("linears", "compute", self.last_end, now, layer=layer, tokens=self.layout.num_tokens(self.rank))
        self.last_end = now

    def _attend(self, q: Tensor, block: Tensor, src: int, acc: dict, scale: float) -> int:
        """This rank's queries against rank `src`'s K/V block; merge into `acc`. Returns pairs."""
        done, koff = 0, 0
        for kc in self.layout.owned[src]:
            n = kc[1] - kc[0]
            k, v = block[0, koff:koff + n], block[1, koff:koff + n]
            koff += n
            for qc, rows in self.rows.items():
                rel = relation(qc, kc)
                if rel == "none":
                    continue
                o, lse = attend_chunk(q[rows], k, v, rel == "causal", scale)
                done += pairs(qc, kc)
                if qc in acc:   # exact merge of two partial softmaxes (adv04)
                    acc[qc] = merge_splits(torch.stack([acc[qc][0], o]), torch.stack([acc[qc][1], lse]))
                else:           # round 0 always starts each chunk with its diagonal: lse finite
                    acc[qc] = (o, lse)
        return done

    def _sink(self, layer: int, src: int, block: Tensor) -> None:
        if self.kv_sink is not None:
            with self.tl.span("K/V to the pool", "other", layer=layer, src=src, tokens=block.shape[1]):
                self.kv_sink(layer, src, block)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.mark_linears(layer_idx)
        if self.hook is not None:
            self.hook(layer_idx)
        lay, cp = self.layout, self.layout.cp
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        block = torch.stack([k, v])                               # [2, n, Hkv, D]: one message a hop
        self._sink(layer_idx, self.rank, block)
        acc: dict[Chunk, tuple[Tensor, Tensor]] = {}
        layer_bytes = 0
        for r in range(cp):
            src = (self.rank - r) % cp                            # whose K/V is in hand this round
            works, incoming = None, None
            if r < cp - 1:                                        # start the hop, then compute
                incoming = block.new_empty((2, lay.num_tokens((src - 1) % cp), *block.shape[2:]))
                works = self.ring.start(block, incoming)
                layer_bytes += block.numel() * block.element_size()
            t0 = time.perf_counter_ns()
            done = self._attend(q, block, src, acc, scale)
            t1 = time.perf_counter_ns()
            self.tl.add(f"attention round {r}", "compute", t0, t1, layer=layer_idx, round=r, src=src, pairs=done)
            self.stats.pairs += done
            self.stats.attention_s += (t1 - t0) / 1e9
            self.stats.rounds.append((layer_idx, r, done, (t1 - t0) / 1e9))
            if works is not None:
                self.ring.finish(works)
                t2 = time.perf_counter_ns()
                self.tl.add("ring wait", "recv", t1, t2, layer=layer_idx, round=r,
                            bytes=block.numel() * block.element_size())
                self.stats.wait_s += (t2 - t1) / 1e9
                block = incoming
                self._sink(layer_idx, (src - 1) % cp, block)
        self.stats.bytes_sent += layer_bytes
        self.stats.bytes_per_layer = layer_bytes
        out = torch.empty_like(q)
        for qc, rows in self.rows.items():
            out[rows] = acc[qc][0].to(q.dtype)
        self.last_end = time.perf_counter_ns()
        return out
