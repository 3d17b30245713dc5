"""Expert-parallel load balancing, in the manner of DeepSeek's EPLB: replicate the hot experts,
then pack the replicas onto the ranks so that every rank gets about the same load.

With expert parallelism each rank holds some experts and computes every token routed to
them; a step lasts as long as its busiest rank. Routing is skewed (some experts are chosen far
more often than others), so "E / R experts per rank, in order" leaves one rank with most of
the work. EPLB takes the load each *logical* expert saw (tokens routed to it, counted on a
real run) and lays out *physical* expert slots, `slots_per_rank` on each rank:

    1. replicate: start with one slot per logical expert; give each of the remaining
       num_replicas - E slots, one at a time, to the expert whose load per replica is the
       highest (a replica takes an equal share of its expert's tokens);
    2. pack: sort the slots by their load, heaviest first, and put each on the least loaded
       rank that still has a free slot (longest-processing-time-first, LPT: a greedy rule;
       without the slots-per-rank limit its busiest rank is within 4/3 of the best possible).

DeepSeek's version does the same two steps, per layer, plus a level above (expert groups onto
nodes first) that this lesson leaves out. The result is three maps, here per layer:

    physical_to_logical [P]          slot p (on rank p // slots_per_rank) runs expert ...
    logical_to_physical [E, R_max]   the slots holding expert e, -1 padded
    replica_counts      [E]          how many slots expert e has
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Placement:
    physical_to_logical: Tensor      # [P] long
    logical_to_physical: Tensor      # [E, max replicas] long, -1 where an expert has fewer
    replica_counts: Tensor           # [E] long
    num_ranks: int

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_of(self, physical: Tensor) -> Tensor:
        return torch.div(physical, self.slots_per_rank, rounding_mode="floor")

    def held_by(self, rank: int) -> list[int]:
        """The logical experts rank `rank` must hold weights for (a duplicate slot shares them)."""
        s = self.slots_per_rank
        return sorted(set(self.physical_to_logical[rank * s:(rank + 1) * s].tolist()))

    def choose_replicas(self, ids: Tensor, start: int = 0) -> Tensor:
        """Logical expert ids [T, k] of a whole step -> physical slot ids [T, k]. The pairs that
        chose expert e take its replicas in turn, in (token, slot) order, from replica `start`
        on: a hot expert's tokens split evenly (to one row) over its replicas, and every rank,
        routing the same step with the same `start`, makes the same choice. (Taking turns by
        the pair's own number would not do: a hot expert is mostly some token's first choice,
        so its pairs' numbers share a remainder.)"""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.replica_counts))
        starts = torch.cumsum(counts, 0) - counts
        turn = torch.empty_like(flat)
        turn[order] = torch.arange(len(flat)) - starts[flat[order]] + start   # its place among its expert's
        return self.logical_to_physical[flat, turn % self.replica_counts[flat]].view(ids.shape)

    def rank_loads(self, load: Tensor) -> Tensor:
        """[num_ranks] expected load per rank when each expert's load [E] splits evenly over its replicas."""
        per_slot = load.double()[self.physical_to_logical] / self.replica_counts[self.physical_to_logical]
        return per_slot.view(self.num_ranks, self.slots_per_rank).sum(1)

    def key(self) -> str:
        """A short text every node compares at the rendezvous (the slots' experts, in order)."""
        return ",".join(map(str, self.physical_to_logical.tolist()))


def _check(load: Tensor, num_replicas: int, num_ranks: int) -> None:
    if load.dim() != 1 or not len(load):
        raise ValueError(f"load must be a 1-D tensor with one entry per logical expert, got shape {tuple(load.shape)}")
    if (load < 0).any():
        raise ValueError("load must be non-negative (tokens routed to each expert)")
    if num_ranks < 1 or num_replicas % num_ranks:
        raise ValueError(f"num_replicas={num_replicas} must be a positive multiple of num_ranks={num_ranks} "
                         f"(every rank gets the same number of slots)")
    if num_replicas < len(load):
        raise ValueError(f"num_replicas={num_replicas} < {len(load)} logical experts: every expert needs a slot")


def placement_from_map(physical_to_logical: list[int], num_experts: int, num_ranks: int) -> Placement:
    """The three maps from the first one, checked: whole slots per rank, every expert placed."""
    if num_ranks < 1 or not physical_to_logical or len(physical_to_logical) % num_ranks:
        raise ValueError(f"{len(physical_to_logical)} physical slots do not split evenly over {num_ranks} ranks")
    if not all(0 <= e < num_experts for e in physical_to_logical):
        raise ValueError(f"a physical slot names an expert outside 0..{num_experts - 1}")
    if missing := sorted(set(range(num_experts)) - set(physical_to_logical)):
        raise ValueError(f"logical experts {missing[:8]} have no physical slot: their tokens could go nowhere")
    p2l = torch.tensor(physical_to_logical, dtype=torch.long)
    counts = torch.bincount(p2l, minlength=num_experts)
    l2p = torch.full((num_experts, int(counts.max())), -1, dtype=torch.long)
    filled = [0] * num_experts
    for p, e in enumerate(physical_to_logical):
        l2p[e, filled[e]] = p
        filled[e] += 1
    return Placement(p2l, l2p, counts, num_ranks)


def static_placement(num_experts: int, num_ranks: int) -> Placement:
    """No replicas, experts in order: rank r holds experts r*E/R .. (r+1)*E/R - 1 (the default
    layout of an expert-parallel engine before any load is known)."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not split evenly over {num_ranks} ranks")
    return placement_from_map(list(range(num_experts)), num_experts, num_ranks)


def rebalance_experts(load: Tensor, num_replicas: int, num_ranks: int) -> Placement:
    """load [E]: tokens routed to each logical expert; num_replicas: physical slots in all
    (>= E, a multiple of num_ranks). Returns the placement (module docstring: the two steps)."""
    _check(load, num_replicas, num_ranks)
    E, load = len(load), load.double()
    replicas = torch.ones(E, dtype=torch.long)
    for _ in range(num_replicas - E):                       # 1. replicate the hottest per replica
        replicas[int(torch.argmax(load / replicas))] += 1
    slots = sorted(((float(load[e] / replicas[e]), e) for e in range(E) for _ in range(int(replicas[e]))),
                   key=lambda s: (-s[0], s[1]))
    per_rank = num_replicas // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for slot_load, e in slots:                              # 2. LPT: heaviest slot to the lightest rank
        r = min((r for r in range(num_ranks) if len(ranks[r]) < per_rank), key=lambda r: (rank_load[r], r))
        ranks[r].append(e)
        rank_load[r] += slot_load
    return placement_from_map([e for r in ranks for e in r], E, num_ranks)


def balancedness(rank_loads: Tensor) -> float:
    """mean / max of the load per rank: 1.0 when every rank does the same work; 1/R when one does all."""
    top = float(rank_loads.max())
    return 1.0 if top == 0 else float(rank_loads.double().mean()) / top
