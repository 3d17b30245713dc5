"""Reading the timeline: bubbles, a fitted cost model, and its prediction for another config.

    measured spans (one run)                fitted model                      prediction
    compute, per stage, with T tokens  -->  stage s: a_s + b_s * T            replay another run's
    LM head on rank 0, N sampled rows  -->  head: h + g * N                   micro-batches (their T,
    send on s .. recv done on s+1      -->  hop: c + bytes / bandwidth        N, bytes, in-flight
    schedule + sample on rank 0        -->  rank 0: o per micro-batch         limit m) through it

The replay is a small event simulation of the engine: rank 0 launches micro-batch k once it
has completed the one launched m steps earlier; stage s starts it when its input has arrived
and it is free. It is a model: it knows nothing of two processes sharing a core, of the
operating system, or of caches, and says so by how far it lands from the measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm_support.timeline import Timeline, busy_fraction, window


@dataclass
class StageCost:
    rank: int
    fixed_s: float           # a: per micro-batch, whatever its size
    per_token_s: float       # b: per token of the micro-batch (for the LM head: per sampled row)

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass
class HopSample:
    src: int
    dst: int
    step: int
    bytes: int
    latency_s: float         # from the start of the send to the end of the receiver's wait


@dataclass
class HopCost:
    fixed_s: float
    per_byte_s: float

    def __call__(self, nbytes: int) -> float:
        return self.fixed_s + self.per_byte_s * nbytes

    @property
    def bandwidth(self) -> float:
        return 1 / self.per_byte_s if self.per_byte_s > 0 else float("inf")


def bubble_fractions(timelines: list[Timeline]) -> list[float]:
    """Per rank: the share of the run's window (over all ranks) it was not computing."""
    win = window(timelines)
    return [1 - busy_fraction(tl, ("compute",), win) for tl in timelines]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a + b*x, with a and b kept >= 0 (a cost has no negative part)."""
    if len(set(xs)) < 2:
        return max(0.0, sum(ys) / len(ys)), 0.0
    X = torch.tensor([[1.0, x] for x in xs], dtype=torch.float64)
    a, b = torch.linalg.lstsq(X, torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    if b < 0:
        return sum(ys) / len(ys), 0.0
    if a < 0:
        return 0.0, sum(ys) / sum(xs)
    return a, b


def _tokens(args: dict) -> int:
    return args["prefill_tokens"] + args["decode_tokens"]


def layer_spans(tl: Timeline) -> list:
    """A rank's compute spans over its layers, one per micro-batch (not rank 0's LM head)."""
    return [s for s in tl.spans if s.cat == "compute" and "micro_batch" in s.args]


def head_spans(tl: Timeline) -> list:
    """Rank 0's LM head over the rows the last stage sent back, one per micro-batch that samples."""
    return [s for s in tl.spans if s.cat == "compute" and "rows" in s.args]


def fit_stage_costs(timelines: list[Timeline]) -> list[StageCost]:
    costs = []
    for tl in timelines:
        spans = layer_spans(tl)
        a, b = _line([_tokens(s.args) for s in spans], [s.dur_ns / 1e9 for s in spans])
        costs.append(StageCost(tl.rank, a, b))
    return costs


def fit_lm_head(tl: Timeline) -> StageCost:
    """Rank 0's LM head: a + b * rows (zero where no span was recorded, e.g. p = 1)."""
    spans = head_spans(tl)
    if not spans:
        return StageCost(tl.rank, 0.0, 0.0)
    return StageCost(tl.rank, *_line([s.args["rows"] for s in spans], [s.dur_ns / 1e9 for s in spans]))


def compute_slowdown(timelines: list[Timeline], costs: list[StageCost]) -> list[float]:
    """Per stage: measured compute time of a run / what the fitted costs say for its micro-batches.
    Near 1: the stages computed as fast as where the model was fitted; above 1: something (the
    other stage on a shared core, another job) slowed the compute itself, which no replay can know."""
    out = []
    for tl, cost in zip(timelines, costs):
        spans = layer_spans(tl)
        out.append(sum(s.dur_ns for s in spans) / 1e9 / max(1e-12, sum(cost(_tokens(s.args)) for s in spans)))
    return out


def hop_samples(timelines: list[Timeline]) -> list[HopSample]:
    """Transfers whose receiver was already waiting when the send began: then the end of its
    wait is the arrival, and end - send start is the hop's cost (clocks aligned by the timeline)."""
    p = len(timelines)
    sends = {(tl.rank, s.args["step"]): s for tl in timelines for s in tl.aligned() if s.cat == "send"}
    recvs = {(tl.rank, s.args["step"]): s for tl in timelines for s in tl.aligned() if s.cat == "recv"}
    out = []
    for (src, step), send in sorted(sends.items()):
        dst = (src + 1) % p
        recv = recvs.get((dst, step))
        if recv is not None and recv.start_ns <= send.start_ns and recv.end_ns >= send.start_ns:
            out.append(HopSample(src, dst, step, send.args["bytes"], (recv.end_ns - send.start_ns) / 1e9))
    return out


def fit_hop(samples: list[HopSample]) -> HopCost:
    if not samples:
        return HopCost(0.0, 0.0)
    return HopCost(*_line([h.bytes for h in samples], [h.latency_s for h in samples]))


def rank0_overhead(tl: Timeline) -> tuple[float, float]:
    """Seconds rank 0 spends per launched micro-batch outside the model: (scheduling, sampling)."""
    launched = max(1, len(layer_spans(tl)))
    return tuple(sum(s.dur_ns for s in tl.spans if s.cat == cat) / 1e9 / launched for cat in ("schedule", "sample"))


@dataclass
class MicroBatch:
    tokens: int
    hidden_bytes: int
    rows: int                # sampled rows: the LM head's work on rank 0
    returned_bytes: int      # the last stage's normed rows back to rank 0


def micro_batches(timelines: list[Timeline]) -> list[MicroBatch]:
    """The micro-batches a run launched, in order, as the replay needs them."""
    sends = {(tl.rank, s.args["step"]): s.args["bytes"] for tl in timelines for s in tl.spans if s.cat == "send"}
    rows = {s.args["step"]: s.args["rows"] for s in head_spans(timelines[0])}
    last = len(timelines) - 1
    out = []
    for s in sorted(layer_spans(timelines[0]), key=lambda s: s.args["step"]):
        k = s.args["step"]
        out.append(MicroBatch(_tokens(s.args), sends.get((0, k), 0), rows.get(k, 0),
                              sends.get((last, k), 0) if last else 0))
    return out


def predict_seconds(batches: list[MicroBatch], costs: list[StageCost], hop: HopCost,
                    overhead_s: tuple[float, float], m: int, head: StageCost | None = None) -> float:
    """Wall time of launching `batches` with at most m in flight, by the fitted model: the
    engine's step k completes micro-batch k-m (wait for its rows, LM head, sample), then launches k."""
    p, (schedule_s, sample_s) = len(costs), overhead_s
    head = head or StageCost(0, 0.0, 0.0)

    def finish(k: int) -> float:          # rank 0's work once micro-batch k is back
        return (head(batches[k].rows) if batches[k].rows else 0.0) + sample_s
    rank0 = 0.0                       # rank 0's clock
    free = [0.0] * p                  # when each later stage is next free
    done: list[float] = []            # when rank 0 can have each micro-batch's logits
    for k, mb in enumerate(batches):
        if k >= m:
            rank0 = max(rank0, done[k - m]) + finish(k - m)
        rank0 += schedule_s + costs[0](mb.tokens)
        t = rank0
        for s in range(1, p):
            t = max(t + hop(mb.hidden_bytes), free[s]) + costs[s](mb.tokens)
            free[s] = t
        done.append(t + hop(mb.returned_bytes) if p > 1 and mb.returned_bytes else t)
    for k in range(max(0, len(batches) - m), len(batches)):    # the last ones still in flight
        rank0 = max(rank0, done[k]) + finish(k)
    return rank0
