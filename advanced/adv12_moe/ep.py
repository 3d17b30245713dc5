"""Expert parallel: each rank holds some experts; a token's hidden state travels to the rank
holding its expert and the expert's output travels back.

Every rank runs the same step (attention replicated, as lesson 17's ranks share one schedule)
and the same router on all T tokens. In each sparse layer, rank r then takes its own share of
the tokens, rows lo..hi, and:

    rank r: my tokens' (token, slot) pairs -> physical slots (eplb.Placement.choose_replicas)
            sorted by slot, so each destination rank's rows are one contiguous run
    1. all_to_all_single(counts)          how many rows I send each rank / receive from each
    2. all_to_all_single(rows), (slot ids) uneven splits: the dispatch
    3. my slots' experts, one matmul per slot over the rows received (moe.run_segments)
    4. all_to_all_single(outputs)          the reverse splits: each row goes home (the combine)
    5. weighted sum over k for my tokens; all_gather the T rows so every rank holds the layer's
       output for the next (replicated) attention

gloo on torch 2.13 has `all_to_all_single` with uneven input/output splits (its list form,
`all_to_all`, wants equal sizes), so the dispatch is one collective per tensor, not pairs of
send/recv. Step 5's all-gather is the price of replicated attention: in a DeepSeek-style
deployment attention is data parallel (each rank's tokens are its own requests) and it goes.

Rows for one expert arrive in (source rank, token) order, which is token order, so an expert
computes exactly the rows, in the order, that one process would: the tokens are the same.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from step17_tensor_parallel.parallel import CollectiveError, CommStats
from advanced.adv12_moe.eplb import Placement
from advanced.adv12_moe.moe import SparseMoE, combine, run_segments

EP_COMM = CommStats()       # what this process spent in the dispatch/combine collectives


def _timed(name: str, fn, *args, nbytes: int = 0) -> None:
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistError when a peer is gone
        raise CollectiveError(f"{name} failed: {e}") from e
    EP_COMM.seconds += time.perf_counter() - t0
    EP_COMM.calls += 1
    EP_COMM.bytes += nbytes


def all_to_all(x: Tensor, send_counts: list[int], recv_counts: list[int], what: str) -> Tensor:
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    _timed(f"all-to-all ({what})", dist.all_to_all_single, out, x.contiguous(), recv_counts, send_counts,
           nbytes=x.numel() * x.element_size())
    return out


def shard(T: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s rows of T tokens: contiguous, sizes differing by at most one."""
    base, extra = divmod(T, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class ExpertParallel:
    """The expert path of every sparse layer on one rank (moe.SparseMoE.expert_path)."""

    def __init__(self, rank: int, world: int, placements: dict[int, Placement]):
        self.rank, self.world, self.placements = rank, world, placements
        # rows each rank computed, per sparse layer: [layers, world], counted from the full routing
        self.rows_per_rank = {layer: torch.zeros(world, dtype=torch.long) for layer in placements}
        self.calls = {layer: 0 for layer in placements}       # the layer's forwards so far (every rank runs each)

    def __call__(self, moe: SparseMoE, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        p, (T, k) = self.placements[moe.layer_idx], ids.shape
        # The whole step's choice, the same on every rank; the first replica moves on every call,
        # so the odd row of an odd count does not always land on the same one.
        all_slots = p.choose_replicas(ids, start=self.calls[moe.layer_idx])
        self.calls[moe.layer_idx] += 1
        self.rows_per_rank[moe.layer_idx] += torch.bincount(p.rank_of(all_slots).reshape(-1), minlength=self.world)
        lo, hi = shard(T, self.rank, self.world)
        slots = all_slots[lo:hi].reshape(-1)
        order = torch.argsort(slots, stable=True)              # my pairs, slot by slot
        send = torch.bincount(p.rank_of(slots), minlength=self.world)
        recv = all_to_all(send, [1] * self.world, [1] * self.world, "row counts")
        send, recv = send.tolist(), recv.tolist()
        rows = all_to_all(x[lo:hi][order // k], send, recv, "dispatch")
        got_slots = all_to_all(slots[order], send, recv, "slot ids")
        out = self._run_local(moe, p, rows, got_slots)
        back = all_to_all(out, recv, send, "combine")            # each row to the rank it came from
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        mine = combine(per_pair.view(hi - lo, k, x.shape[1]), weights[lo:hi])
        return self._gather(mine, T)

    def _run_local(self, moe: SparseMoE, p: Placement, rows: Tensor, slots: Tensor) -> Tensor:
        """The received rows through this rank's slots: sorted by slot (stable: token order within
        a slot), one matmul per slot, back to the order they arrived in."""
        first = self.rank * p.slots_per_rank
        local = slots - first
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=p.slots_per_rank).tolist()
        logical = p.physical_to_logical[first:first + p.slots_per_rank].tolist()
        out_sorted = run_segments(rows[order], counts, lambda j: moe.expert(logical[j]))
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return out

    def _gather(self, mine: Tensor, T: int) -> Tensor:
        """Every rank's rows, in rank order: [T, H] on all ranks (padded to equal sizes for gloo)."""
        width = -(-T // self.world)
        padded = mine.new_zeros(width, mine.shape[1])
        padded[:len(mine)] = mine
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        _timed("all-gather (expert outputs)", dist.all_gather, parts, padded,
               nbytes=padded.numel() * padded.element_size())
        return torch.cat([part[:b - a] for part, (a, b) in
                          zip(parts, (shard(T, r, self.world) for r in range(self.world)))])
