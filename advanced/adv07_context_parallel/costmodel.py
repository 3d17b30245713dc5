"""A small cost model of a context-parallel prefill, fitted from measured runs.

Per layer, each rank does two kinds of compute and the ring adds one kind of transfer:

    linears   a * n                n = the rank's tokens (norms, q/k/v, o_proj, MLP)
    attention b * pairs            pairs = (query, key) score elements (zigzag.pairs), ~T^2/(2 cp)
    a hop     c + bytes / bw       bytes = 2 * n * Hkv * D * itemsize (the K and V of n tokens)

The ring runs in lock-step rounds: round r's hop travels while round r's attention computes,
and round r+1 needs the block, so a round costs max(slowest rank's attention, hop). A layer:

    layer(T, cp) = max_rank(a * n_rank) + sum_rounds max(max_rank b * pairs[rank, round], hop)

a and b come from the timeline's spans ("linears", "attention round r"), c and bw from bare
hops of a few sizes (engine.measure_hops). Compute grows ~T^2/cp, the bytes ~T/cp, so a long
enough prompt hides every hop behind attention; a slow link or a short prompt does not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advanced.adv07_context_parallel.zigzag import make_layout, pairs
from minivllm_support.timeline import Timeline


@dataclass
class Costs:
    a: float          # s per token per layer: the linears
    b: float          # s per score element per layer (all heads): attention
    c: float = 0.0    # s per hop, fixed
    bw: float = float("inf")   # bytes/s of a hop

    def hop(self, nbytes: int) -> float:
        return self.c + nbytes / self.bw


def fit_compute(timelines: list[Timeline]) -> tuple[float, float]:
    """a, b by least squares through the origin over every span of every rank and run."""
    lin = [(s.args["tokens"], s.dur_ns / 1e9) for tl in timelines for s in tl.spans if s.name == "linears"
           and s.args.get("layer", 0) > 0]          # layer 0's span also holds the embedding lookup
    att = [(s.args["pairs"], s.dur_ns / 1e9) for tl in timelines for s in tl.spans
           if s.name.startswith("attention round") and s.args["pairs"]]
    return _through_origin(lin), _through_origin(att)


def fit_link(hops: list[tuple[int, float]]) -> tuple[float, float]:
    """c, bw from (bytes, seconds) of bare hops: a straight line, intercept c, slope 1/bw."""
    x = torch.tensor([h[0] for h in hops], dtype=torch.float64)
    y = torch.tensor([h[1] for h in hops], dtype=torch.float64)
    A = torch.stack([torch.ones_like(x), x], 1)
    c, slope = torch.linalg.lstsq(A, y[:, None]).solution[:, 0].tolist()
    return max(c, 0.0), 1.0 / max(slope, 1e-15)


def _through_origin(points: list[tuple[float, float]]) -> float:
    if not points:
        raise ValueError("no spans to fit: was the timeline enabled?")
    return sum(x * y for x, y in points) / sum(x * x for x, _ in points)


def layer_seconds(costs: Costs, T: int, cp: int, kv_bytes_per_token: int, zigzag: bool = True) -> float:
    """One layer of a T-token prefill over cp ranks, by the rounds of the ring."""
    lay = make_layout(T, cp, zigzag)
    t = max(costs.a * lay.num_tokens(r) for r in range(cp))
    for rnd in range(cp):
        attn = max(costs.b * sum(pairs(q, k) for q in lay.owned[r] for k in lay.owned[(r - rnd) % cp])
                   for r in range(cp))
        hop = 0.0 if rnd == cp - 1 else max(costs.hop(lay.num_tokens(r) * kv_bytes_per_token) for r in range(cp))
        t += max(attn, hop)
    return t


def prefill_seconds(costs: Costs, T: int, cp: int, layers: int, kv_bytes_per_token: int,
                    zigzag: bool = True) -> float:
    return layers * layer_seconds(costs, T, cp, kv_bytes_per_token, zigzag)


LENGTHS = tuple(int(16 * 2 ** (k / 2)) for k in range(0, 31))     # 16 .. 524k tokens, x1.41 steps


def pays_from(costs: Costs, cp: int, kv_bytes_per_token: int, gain: float, lengths=LENGTHS) -> int | None:
    """Shortest prompt (of `lengths`) at which cp ranks prefill `gain` x faster than one rank
    (every rank its own hardware, as fast as the ranks measured). None: not within `lengths`."""
    for T in lengths:
        if T >= 2 * cp and layer_seconds(costs, T, 1, kv_bytes_per_token) >= \
                gain * layer_seconds(costs, T, cp, kv_bytes_per_token):
            return T
    return None


def hidden_from(costs: Costs, cp: int, kv_bytes_per_token: int, lengths=LENGTHS) -> int | None:
    """Shortest prompt at which every hop hides behind its round's attention."""
    for T in lengths:
        if T < 2 * cp:
            continue
        lay = make_layout(T, cp)
        n = max(lay.num_tokens(r) for r in range(cp))
        round_attn = min(costs.b * sum(pairs(q, k) for q in lay.owned[r] for k in lay.owned[(r - 1) % cp])
                         for r in range(cp))
        if round_attn >= costs.hop(n * kv_bytes_per_token):
            return T
    return None


def scaled(costs: Costs, speedup: float) -> Costs:
    """The same link, ranks `speedup` x faster at compute (a what-if, not a measurement)."""
    return Costs(costs.a / speedup, costs.b / speedup, costs.c, costs.bw)
