"""How much communication the overlap hid, read from the timeline (recorder.py's rows).

    all-reduce of A   |===========|                 its own time: start -> sum complete
    compute of B         |#####|  |###              the other micro-batch's compute meanwhile
    hidden               ^^^^^^^  ^                 the part of A's all-reduce covered by B's work

hidden fraction = sum over all-reduces of (time covered by the *other* micro-batch's compute)
                  / sum over all-reduces of (their own time)

Only the other micro-batch's compute counts: the lane's own next work cannot start before its
sum is in, so it never hides its own all-reduce. An unsplit step (one lane, "all") has no other
micro-batch: nothing of its all-reduces is hidden, by construction, and that is the baseline.
The embedding's all-reduce (once a step, synchronous) is not on the all-reduce rows.
"""
from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from minivllm_support.timeline import Span, Timeline
from advanced.adv09_overlap.recorder import ROWS_PER_RANK


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping union of [a, b) intervals."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered_ns(a: int, b: int, merged: list[tuple[int, int]], starts: list[int]) -> int:
    """Length of [a, b) covered by `merged` (its starts listed in `starts`)."""
    total = 0
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        total += max(0, hi - lo)
        i += 1
    return total


@dataclass
class OverlapStats:
    reduce_ns: list[int]  # each all-reduce's own time (start -> sum complete)
    hidden_ns: int        # of their time, the part covered by the other micro-batch's compute
    wait_ns: int          # time the compute thread sat waiting for a sum (not hidden)
    layer_compute_ns: list[int]     # every half-layer compute span (one lane's attention or MLP)

    @property
    def all_reduces(self) -> int:
        return len(self.reduce_ns)

    @property
    def comm_ns(self) -> int:
        return sum(self.reduce_ns)

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ns / self.comm_ns if self.comm_ns else 0.0

    def mean_all_reduce_us(self) -> float:
        return statistics.fmean(self.reduce_ns) / 1e3 if self.reduce_ns else 0.0

    def mean_half_layer_us(self) -> float:
        """One lane's attention or MLP half, averaged (means, not medians: they add up to a step)."""
        return statistics.fmean(self.layer_compute_ns) / 1e3 if self.layer_compute_ns else 0.0


def overlap_stats(compute: Iterable[Span], reduces: Iterable[Span]) -> OverlapStats:
    """The stats of one rank: its compute-row spans and its all-reduce-row spans (args["mb"] on each)."""
    compute = list(compute)
    work = [s for s in compute if s.cat == "compute"]
    by_mb = {mb: merge((s.start_ns, s.end_ns) for s in work if s.args.get("mb") == mb)
             for mb in {s.args.get("mb") for s in work}}
    starts = {mb: [a for a, _ in iv] for mb, iv in by_mb.items()}
    durations, hidden = [], 0
    for r in reduces:
        if r.cat != "collective":
            continue
        durations.append(r.dur_ns)
        mine = r.args.get("mb")
        if mine == "all":
            continue                        # an unsplit step: no other micro-batch to hide behind
        for mb, iv in by_mb.items():
            if mb not in (mine, "all"):
                hidden += covered_ns(r.start_ns, r.end_ns, iv, starts[mb])
    wait = sum(s.dur_ns for s in compute if s.cat == "wait")
    layers = [s.dur_ns for s in work if "layer" in s.args]
    return OverlapStats(durations, hidden, wait, layers)


def rank_stats(timelines: Iterable[Timeline], overlap: bool | None = None,
               steps: set[int] | None = None) -> dict[int, OverlapStats]:
    """{rank: stats} from every rank's rows; only the steps run with `overlap` (None: all) and,
    if given, only the step numbers in `steps`."""
    def keep(s: Span) -> bool:
        return (overlap is None or s.args.get("overlap") == overlap) and (steps is None or s.args.get("step") in steps)
    rows: dict[int, tuple[list[Span], list[Span]]] = {}
    for tl in timelines:
        rank, kind = divmod(tl.rank, ROWS_PER_RANK)
        compute, reduces = rows.setdefault(rank, ([], []))
        (compute if kind == 0 else reduces).extend(s for s in tl.aligned() if keep(s))
    return {rank: overlap_stats(c, r) for rank, (c, r) in sorted(rows.items())}


def half_layer_model(c_full: float, r_full: float, c_mb: float, r_mb: float) -> tuple[float, float]:
    """(plain, overlap) time of one half layer (attention or MLP) from its measured pieces.

    plain:    compute the whole batch (c_full), then wait for its all-reduce (r_full): c + r
    overlap:  lane A computes (c_mb) and starts its all-reduce (r_mb); B computes meanwhile; A's
              next half starts when both B's compute and A's sum are done. In the steady state a
              half layer takes max(2 c_mb, c_mb + r_mb) (gloo runs A's and B's sums side by side).
    Overlap wins when max(2 c_mb, c_mb + r_mb) < c_full + r_full: when compute dominates, the
    split's own cost (2 c_mb - c_full: two smaller matmuls, every per-call overhead twice) must
    be below the all-reduce it hides; when communication dominates, it saves at most the
    compute of one half, and only if the all-reduces do not get slower for running beside
    compute and beside each other (r_mb close to r_full)."""
    return c_full + r_full, max(2 * c_mb, c_mb + r_mb)
