"""From the timeline to a cost model, and from the model to the attention:FFN ratio that balances them.

    measured spans (one run)                          fitted model
    rank 0: attention half of layer l, micro-batch i  attn(T, K) = a + b*T + c*K    (T tokens, K KV tokens read)
    FFN:    MLP half of layer l, micro-batch i        ffn(T)    = d + e*T
    rank 0: wait for FFN output - FFN compute         hop       = h                (both transfers + overheads)

One layer of a step, with its micro-batches (T_i, K_i), n_ffn FFN ranks and micro-batch i on
FFN rank 1 + i % n_ffn, goes no faster than the busiest of three things:

    rank 0:       sum_i attn(T_i, K_i)                    (attention of every micro-batch)
    an FFN rank:  sum over its micro-batches of ffn(T_i)
    one chain:    attn(T_i, K_i) + ffn(T_i) + h           (i's next layer needs i's FFN output;
                                                          h: both transfers)

With m = 1 the chain is the whole layer: each side idles while the other works. With m >= 2 the
sides overlap and the slower side sets the pace. Balanced means both sides take the same time:
with n_a attention and n_f FFN workers sharing a batch, attn(B/n_a, ...) = ffn(B n_a / n_f / n_a)
per worker, i.e. n_a / n_f = attention time / FFN time for the same tokens (`balanced_ratio`).
It is a model: it knows nothing of processes sharing cores, and says so by how far it lands.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm_support.timeline import Span, Timeline, busy_ns
from advanced.adv11_afd.microbatch import ffn_rank


@dataclass
class LayerCost:
    """Seconds for one layer half of one micro-batch: fixed + per token + per KV token read."""
    fixed_s: float
    per_token_s: float
    per_kv_token_s: float = 0.0

    def __call__(self, tokens: int, kv_tokens: int = 0) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_kv_token_s * kv_tokens


def fit_nonnegative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares y = rows @ coef with every coefficient >= 0 (a cost has no negative part):
    a coefficient the fit wants negative is dropped (set to 0) and the rest refitted."""
    if not rows:
        raise ValueError("no samples to fit")
    active = list(range(len(rows[0])))
    X, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)[:, None]
    while True:
        coef = [0.0] * len(rows[0])
        if active:
            sol = torch.linalg.lstsq(X[:, active], y).solution[:, 0].tolist()
            for j, c in zip(active, sol):
                coef[j] = c
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def attention_spans(tl: Timeline) -> list[Span]:
    return [s for s in tl.spans if s.cat == "compute" and "kv_tokens" in s.args]


def ffn_spans(tl: Timeline) -> list[Span]:
    return [s for s in tl.spans if s.cat == "compute" and "layer" in s.args and "kv_tokens" not in s.args]


def fit_attention(tl: Timeline) -> LayerCost:
    spans = attention_spans(tl)
    return LayerCost(*fit_nonnegative([[1.0, s.args["tokens"], s.args["kv_tokens"]] for s in spans],
                                      [s.dur_ns / 1e9 for s in spans]))


def fit_ffn(timelines: list[Timeline]) -> LayerCost:
    spans = [s for tl in timelines[1:] for s in ffn_spans(tl)]
    return LayerCost(*fit_nonnegative([[1.0, s.args["tokens"]] for s in spans], [s.dur_ns / 1e9 for s in spans]))


def hop_samples(timelines: list[Timeline]) -> list[float]:
    """Per exchange of a step run as one micro-batch (rank 0 waits for it right after sending it):
    the round trip less the FFN's compute, i.e. two transfers and the FFN side's receive/send overhead."""
    ffn = {(s.args["step"], s.args["layer"], s.args["micro_batch"]): s.dur_ns / 1e9
           for tl in timelines[1:] for s in ffn_spans(tl)}
    single = {shape.step for shape in step_shapes(timelines[0]) if len(shape.micro_batches) == 1}
    out = []
    for s in timelines[0].spans:
        key = (s.args.get("step"), s.args.get("layer"), s.args.get("micro_batch"))
        if s.cat == "recv" and key in ffn and key[0] in single:
            out.append(max(0.0, s.args["round_trip_us"] / 1e6 - ffn[key]))
    return out


def fit_hop(timelines: list[Timeline]) -> float:
    """The mean exchange: what the run's total time pays, an occasional stall of a busy machine included."""
    samples = hop_samples(timelines)
    return sum(samples) / len(samples) if samples else 0.0


@dataclass
class StepShape:
    """One step as the model needs it: the layers, and (tokens, KV tokens) of each micro-batch of
    rank 0 and (2:1) of each other attention rank (`peers`); an idle rank has none."""
    step: int
    layers: int
    micro_batches: list[tuple[int, int]]
    peers: list[list[tuple[int, int]]] = field(default_factory=list)


def step_shapes(tl: Timeline, peers: list[Timeline] = ()) -> list[StepShape]:
    """Every step in which some attention rank (rank 0's timeline `tl`, then `peers`) computed."""
    by_step: dict[int, list[dict[int, tuple[int, int]]]] = {}
    layers: dict[int, int] = {}
    for a, timeline in enumerate([tl, *peers]):
        for s in attention_spans(timeline):
            x = s.args
            by_step.setdefault(x["step"], [{} for _ in range(1 + len(peers))])[a][x["micro_batch"]] = \
                (x["tokens"], x["kv_tokens"])
            layers[x["step"]] = max(layers.get(x["step"], 0), x["layer"] + 1)
    return [StepShape(k, layers[k], *[[mbs[i] for i in sorted(mbs)] for mbs in ranks[:1]],
                      [[mbs[i] for i in sorted(mbs)] for mbs in ranks[1:]]) for k, ranks in sorted(by_step.items())]


def layer_times(shape: StepShape, attn: LayerCost, ffn: LayerCost, hop: float, n_ffn: int) -> tuple[float, float, float]:
    """(cycle, the busiest attention rank's busy time, the busiest FFN rank's busy time) of one
    layer of this step. With several attention ranks, micro-batch i of all of them is one FFN call."""
    ranks = [shape.micro_batches, *shape.peers]
    a = [[attn(t, k) for t, k in mbs] for mbs in ranks]
    slots = max(len(mbs) for mbs in ranks)
    f = [ffn(sum(mbs[i][0] for mbs in ranks if i < len(mbs))) for i in range(slots)]
    per_rank = [sum(fi for i, fi in enumerate(f) if ffn_rank(i, n_ffn) == r) for r in range(1, n_ffn + 1)]
    chain = max(max(ai[i] for ai in a if i < len(ai)) + f[i] + hop for i in range(slots))
    busiest = max(sum(ai) for ai in a)
    return max(busiest, max(per_rank), chain), busiest, max(per_rank)


@dataclass
class LoopPrediction:
    seconds: float               # the steps' layer loops, end to end
    attention_busy: float        # share of it rank 0 computes attention halves
    ffn_busy: float              # share of it the busiest FFN rank computes


def predict_loops(shapes: list[StepShape], attn: LayerCost, ffn: LayerCost, hop: float, n_ffn: int) -> LoopPrediction:
    total = a_busy = f_busy = 0.0
    for shape in shapes:
        cycle, a, f = layer_times(shape, attn, ffn, hop, n_ffn)
        total, a_busy, f_busy = total + shape.layers * cycle, a_busy + shape.layers * a, f_busy + shape.layers * f
    return LoopPrediction(total, a_busy / max(total, 1e-12), f_busy / max(total, 1e-12))


def measured_loops(timelines: list[Timeline]) -> LoopPrediction:
    """The same three numbers from a run's timeline: each step's layer loop runs from the first
    attention half to the last wait for the FFN on any attention rank (rank 0 and, at 2:1, the
    peer); busy time (of the busiest rank of each side) is counted inside those windows."""
    attention = [timelines[0]] + [tl for tl in timelines[1:] if attention_spans(tl)]
    windows: dict[int, list[int]] = {}
    for tl in attention:
        for s in tl.aligned():
            if "layer" in s.args and (s.cat == "recv" or "kv_tokens" in s.args):
                w = windows.setdefault(s.args["step"], [s.start_ns, s.end_ns])
                w[0], w[1] = min(w[0], s.start_ns), max(w[1], s.end_ns)
    total = sum(b - a for a, b in windows.values())

    def busy(tl: Timeline, spans: list[Span]) -> int:
        only = Timeline(tl.rank, spans=spans, offset_ns=tl.offset_ns)
        return sum(busy_ns(only, ("compute",), tuple(w)) for w in windows.values())
    attn = max(busy(tl, attention_spans(tl)) for tl in attention)
    ffn = max((busy(tl, ffn_spans(tl)) for tl in timelines[1:] if all(tl is not a for a in attention)), default=0)
    return LoopPrediction(total / 1e9, attn / max(total, 1), ffn / max(total, 1))


def balanced_ratio(attn: LayerCost, ffn: LayerCost, batch: int, context: int) -> float:
    """Attention workers per FFN worker that balance a decode batch of `batch` sequences at
    `context` tokens each: attention time / FFN time for the same tokens."""
    return attn(batch, batch * context) / ffn(batch)
