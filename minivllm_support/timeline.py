"""A step timeline for the multi-process lessons: who computed, sent, waited, and when.

A pipeline bubble, a ring transfer that does not hide behind compute, a replica waiting for work:
these are easiest to see on a picture with one row per process and time running right.

    rank 0 |##compute mb0##|send|##compute mb1##|send|..wait..|#sample#|##compute mb0##|
    rank 1 |....recv wait.........|##compute mb0##|##compute mb1##|send |.....
                                  ^ the bubble: rank 1 has nothing to do yet

Each process keeps one `Timeline` and wraps what it does in spans:

    tl = Timeline(rank=1, name="stage 1")
    with tl.span("forward", "compute", step=7, prefill_tokens=0, decode_tokens=8):
        ...

Workers send `tl.to_dict()` to rank 0, which writes them all as a Chrome trace (open the JSON in
https://ui.perfetto.dev or chrome://tracing) and as a PNG drawn by matplotlib.

Clocks: `time.perf_counter_ns` is CLOCK_MONOTONIC on Linux, one clock for every process of a
machine; across machines it is not. `measure_offset` / `answer_offset` estimate a worker's offset
from rank 0's clock with a few ping-pongs over a pipe (the NTP idea: the reply was stamped halfway
through the round trip); the smallest round trip gives the tightest estimate.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("compute", "send", "recv", "collective", "wait", "schedule", "sample", "other")
COLOURS = {"compute": "#2b7bba", "send": "#e6862a", "recv": "#f2c14e", "collective": "#c0392b",
           "wait": "#d5d8dc", "schedule": "#27ae60", "sample": "#8e44ad", "other": "#7f8c8d"}


@dataclass
class Span:
    name: str
    cat: str
    start_ns: int
    end_ns: int
    args: dict = field(default_factory=dict)

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class Timeline:
    """The spans of one process (a rank). `offset_ns` is added to its clock when merged."""
    rank: int
    name: str = ""
    spans: list[Span] = field(default_factory=list)
    offset_ns: int = 0
    enabled: bool = True

    @contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[dict]:
        """Time the body; the yielded dict may be filled with more args inside it (bytes, ...)."""
        if not self.enabled:
            yield args
            return
        start = time.perf_counter_ns()
        try:
            yield args
        finally:
            self.add(name, cat, start, time.perf_counter_ns(), **args)

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, **args) -> None:
        if cat not in CATEGORIES:
            raise ValueError(f"unknown span category {cat!r}; one of {', '.join(CATEGORIES)}")
        if self.enabled:
            self.spans.append(Span(name, cat, start_ns, end_ns, args))

    def clear(self) -> None:
        self.spans.clear()

    def to_dict(self) -> dict:
        return {"rank": self.rank, "name": self.name, "offset_ns": self.offset_ns,
                "spans": [(s.name, s.cat, s.start_ns, s.end_ns, s.args) for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        return cls(d["rank"], d.get("name", ""), [Span(*s) for s in d["spans"]], d.get("offset_ns", 0))

    def aligned(self) -> list[Span]:
        """The spans on rank 0's clock."""
        o = self.offset_ns
        return [Span(s.name, s.cat, s.start_ns + o, s.end_ns + o, s.args) for s in self.spans]


# ---- clock alignment over a pipe (multiprocessing Connection) -----------------------------------
def measure_offset(conn, rounds: int = 8) -> int:
    """Rank 0's side: ns to add to the worker's clock to get rank 0's. The worker runs answer_offset."""
    best_rtt, offset = None, 0
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        conn.send(("clock", t0))
        worker_t = conn.recv()
        t1 = time.perf_counter_ns()
        if best_rtt is None or t1 - t0 < best_rtt:
            best_rtt, offset = t1 - t0, (t0 + t1) // 2 - worker_t
    conn.send(("clock", None))
    return offset


def answer_offset(conn) -> None:
    """The worker's side of measure_offset: stamp each ping with this process's clock."""
    while True:
        kind, value = conn.recv()
        if kind != "clock":
            raise RuntimeError(f"clock alignment: expected a 'clock' message, got {kind!r}")
        if value is None:
            return
        conn.send(time.perf_counter_ns())


# ---- measures -----------------------------------------------------------------------------------
def window(timelines: Iterable[Timeline]) -> tuple[int, int]:
    """First start and last end over every rank, on rank 0's clock."""
    spans = [s for tl in timelines for s in tl.aligned()]
    if not spans:
        raise ValueError("no spans recorded")
    return min(s.start_ns for s in spans), max(s.end_ns for s in spans)


def busy_ns(tl: Timeline, cats: tuple[str, ...] = ("compute",), win: tuple[int, int] | None = None) -> int:
    """Time inside `win` covered by spans of `cats` (overlapping spans counted once)."""
    lo, hi = win or (-(1 << 62), 1 << 62)
    pieces = sorted((max(s.start_ns, lo), min(s.end_ns, hi)) for s in tl.aligned() if s.cat in cats)
    total, cur_start, cur_end = 0, None, None
    for a, b in pieces:
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def busy_fraction(tl: Timeline, cats: tuple[str, ...] = ("compute",), win: tuple[int, int] | None = None) -> float:
    """Share of the window this rank spent in `cats`; 1 - it is the rank's bubble (idle share)."""
    lo, hi = win or window([tl])
    return busy_ns(tl, cats, (lo, hi)) / max(1, hi - lo)


def bubble_formula(p: int, m: int) -> float:
    """GPipe's idle share of each stage for one batch split into m micro-batches over p stages."""
    return (p - 1) / (m + p - 1)


# ---- Chrome trace -------------------------------------------------------------------------------
def chrome_trace(timelines: Iterable[Timeline]) -> dict:
    """Complete ('X') events in microseconds from the earliest span; one process row per rank."""
    timelines = list(timelines)
    t0, _ = window(timelines)
    events = []
    for tl in timelines:
        label = tl.name or f"rank {tl.rank}"
        events.append({"name": "process_name", "ph": "M", "pid": tl.rank, "tid": 0, "args": {"name": label}})
        for s in tl.aligned():
            events.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": tl.rank, "tid": 0,
                           "ts": (s.start_ns - t0) / 1e3, "dur": s.dur_ns / 1e3, "args": s.args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timelines: Iterable[Timeline], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timelines), default=str))
    return path


def validate_trace(trace: dict) -> list[str]:
    """Problems with a trace (empty: fine): fields present, durations >= 0, times >= 0, and on each
    rank spans either nest or follow each other (a process does one thing at a time, or a part of it)."""
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    by_rank: dict[int, list[tuple[float, float, str]]] = {}
    for i, e in enumerate(events):
        if e.get("ph") == "M":
            continue
        missing = [k for k in ("name", "ph", "pid", "tid", "ts", "dur") if k not in e]
        if missing:
            problems.append(f"event {i} lacks {missing}")
            continue
        if e["dur"] < 0 or e["ts"] < 0:
            problems.append(f"event {i} ({e['name']}) has ts={e['ts']} dur={e['dur']}")
        by_rank.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    eps = 1e-3   # microseconds: rounding of ns -> us
    for rank, spans in by_rank.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for a, b, name in spans:
            while stack and stack[-1][1] <= a + eps:
                stack.pop()
            if stack and b > stack[-1][1] + eps:
                problems.append(f"rank {rank}: {name!r} [{a:.1f}, {b:.1f}] us overlaps "
                                f"{stack[-1][2]!r} [{stack[-1][0]:.1f}, {stack[-1][1]:.1f}] without nesting")
            stack.append((a, b, name))
    return problems


# ---- picture ------------------------------------------------------------------------------------
def draw_png(timelines: Iterable[Timeline], path: str | Path, title: str = "") -> Path:
    """A Gantt chart: one row per rank, one bar per span (nested spans drawn thinner on top)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = sorted(timelines, key=lambda tl: tl.rank)
    t0, t1 = window(timelines)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(timelines)))
    used = set()
    for row, tl in enumerate(timelines):
        spans = sorted(tl.aligned(), key=lambda s: (s.start_ns, -s.end_ns))
        depth_end: list[int] = []
        for s in spans:
            while depth_end and depth_end[-1] <= s.start_ns:
                depth_end.pop()
            depth = len(depth_end)
            depth_end.append(s.end_ns)
            height = 0.6 / (1 + depth)
            ax.broken_barh([((s.start_ns - t0) / 1e6, max(s.dur_ns / 1e6, 1e-3))], (row - height / 2, height),
                           facecolors=COLOURS.get(s.cat, "#7f8c8d"), edgecolor="none")
            used.add(s.cat)
    ax.set_yticks(range(len(timelines)), [tl.name or f"rank {tl.rank}" for tl in timelines])
    ax.set_ylim(len(timelines) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_xlabel("ms")
    if title:
        ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[c]) for c in CATEGORIES if c in used]
    ax.legend(handles, [c for c in CATEGORIES if c in used], loc="upper center", bbox_to_anchor=(0.5, -0.35),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")     # no empty band under the legend
    plt.close(fig)
    return path
