"""What each rank records of its steps, on the shared timeline (minivllm_support/timeline.py).

One rank is three rows, because its all-reduces run beside its compute (and A's beside B's):

    rank r: compute                 |A attn L0|B attn L0|wait A|A mlp L0|...   (one thread: spans follow
                                                                               each other or nest)
    rank r: all-reduces of A        |== A attn L0 ==|    |=== A mlp L0 ===|    start -> sum complete
    rank r: all-reduces of B                  |=== B attn L0 ===|       ...

A span on an all-reduce row runs from the call that started it to the moment gloo had the sum
(a callback on gloo's side), so it is the collective's own time, not the time until the
compute thread came back for it; a "wait" span on the compute row is the part nobody hid.
Row ids are 3r, 3r + 1, 3r + 2 (Timeline.rank), so rank r's rows sort together.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from minivllm_support.timeline import Timeline

ROWS_PER_RANK = 3
# An engine nobody asks for its timeline (a server) must not grow without bound: past this many
# spans a row drops its older half (about 600 steps of a 30-layer model split in two).
MAX_SPANS_PER_ROW = 100_000


class StepRecorder:
    def __init__(self, rank: int, enabled: bool = True):
        self.rank = rank
        # An unsplit step's all-reduces go on A's row (it has no other micro-batch).
        self.rows = [Timeline(ROWS_PER_RANK * rank + i, f"rank {rank}: {what}", enabled=enabled)
                     for i, what in enumerate(("compute", "all-reduces A", "all-reduces B"))]
        self.step = 0               # set by the caller before each step: the same number on every rank
        self.overlap = False

    def begin_step(self, step: int, overlap: bool) -> None:
        """Stamp what follows with this step's number and schedule (the same on every rank)."""
        self.step, self.overlap = step, overlap
        for tl in self.rows:
            if len(tl.spans) > MAX_SPANS_PER_ROW:
                del tl.spans[:len(tl.spans) // 2]

    @property
    def compute_row(self) -> Timeline:
        return self.rows[0]

    def reduce_row(self, mb: str) -> Timeline:
        return self.rows[2] if mb == "B" else self.rows[1]

    @contextmanager
    def compute(self, name: str, mb: str, **args) -> Iterator[dict]:
        with self.compute_row.span(name, "compute", mb=mb, step=self.step, overlap=self.overlap, **args) as a:
            yield a

    def add_wait(self, mb: str, start_ns: int, end_ns: int, layer: int) -> None:
        self.compute_row.add(f"wait {mb}", "wait", start_ns, end_ns, mb=mb, step=self.step, overlap=self.overlap,
                             layer=layer)

    def add_all_reduce(self, mb: str, name: str, start_ns: int, end_ns: int, nbytes: int, layer: int) -> None:
        self.reduce_row(mb).add(f"all-reduce {name}", "collective", start_ns, end_ns, mb=mb, step=self.step,
                                overlap=self.overlap, bytes=nbytes, layer=layer)

    def timed(self, name: str, cat: str = "compute") -> AbstractContextManager:
        """A span of the whole step's work outside the layers (the LM head and its gather)."""
        return self.compute_row.span(name, cat, mb="all", step=self.step, overlap=self.overlap)

    # ---- sent to rank 0 and back -----------------------------------------------------------
    def to_dicts(self) -> list[dict]:
        return [tl.to_dict() for tl in self.rows]

    def clear(self) -> None:
        for tl in self.rows:
            tl.clear()
