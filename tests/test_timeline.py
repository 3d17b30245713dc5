"""The shared step timeline: spans, clock alignment, busy share, Chrome trace and its checks."""
from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from minivllm_support.timeline import (Timeline, answer_offset, bubble_formula, busy_fraction, busy_ns,
                                       chrome_trace, draw_png, measure_offset, validate_trace, window,
                                       write_chrome_trace)


def _two_ranks() -> list[Timeline]:
    a, b = Timeline(0, "stage 0"), Timeline(1, "stage 1")
    a.add("step", "schedule", 0, 100)
    a.add("forward", "compute", 10, 60, step=0, decode_tokens=4)
    a.add("send", "send", 60, 70, bytes=1024)
    b.add("recv", "recv", 0, 70)
    b.add("forward", "compute", 70, 120, step=0)
    return [a, b]


def test_busy_share_counts_overlaps_once_and_respects_the_window():
    tl = Timeline(0)
    tl.add("x", "compute", 0, 50)
    tl.add("y", "compute", 25, 75)        # overlaps x: 0..75 busy
    tl.add("z", "send", 75, 100)
    assert busy_ns(tl) == 75
    assert busy_fraction(tl, win=(0, 100)) == pytest.approx(0.75)
    assert busy_fraction(tl, ("compute", "send"), (0, 100)) == pytest.approx(1.0)
    assert busy_ns(tl, win=(50, 100)) == 25


def test_bubble_formula():
    assert bubble_formula(2, 1) == pytest.approx(0.5)
    assert bubble_formula(4, 4) == pytest.approx(3 / 7)
    assert bubble_formula(1, 8) == 0


def test_trace_round_trips_and_validates(tmp_path):
    tls = _two_ranks()
    tls[1].offset_ns = 5                             # rank 1's clock is 5 ns behind rank 0's
    assert window(tls) == (0, 125)
    path = write_chrome_trace(tls, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    assert validate_trace(trace) == []
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    fwd1 = next(e for e in xs if e["pid"] == 1 and e["name"] == "forward")
    assert fwd1["ts"] == pytest.approx(0.075) and fwd1["args"] == {"step": 0}
    again = Timeline.from_dict(json.loads(json.dumps(tls[0].to_dict())))
    assert [s.name for s in again.spans] == ["step", "forward", "send"]


def test_validate_names_overlapping_spans_and_bad_fields():
    tl = Timeline(0)
    tl.add("a", "compute", 0, 50)
    tl.add("b", "send", 40, 90)                      # starts inside a, ends after it
    problems = validate_trace(chrome_trace([tl]))
    assert len(problems) == 1 and "'b'" in problems[0] and "'a'" in problems[0]
    assert validate_trace({"traceEvents": [{"name": "x", "ph": "X", "pid": 0, "tid": 0, "ts": 0}]})
    assert validate_trace({}) == ["no traceEvents list"]
    with pytest.raises(ValueError, match="unknown span category"):
        tl.add("c", "thinking", 0, 1)


def test_span_context_records_args_added_inside():
    tl = Timeline(0)
    with tl.span("send", "send", step=3) as args:
        args["bytes"] = 64
    (s,) = tl.spans
    assert s.args == {"step": 3, "bytes": 64} and s.end_ns >= s.start_ns


def _worker(conn):
    answer_offset(conn)


def test_clock_offset_between_processes_on_one_machine_is_small():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(child,))
    p.start()
    try:
        offset = measure_offset(parent)
    finally:
        p.join(10)
    assert p.exitcode == 0
    assert abs(offset) < 50_000_000          # one monotonic clock per machine: only pipe jitter


def test_png_is_written(tmp_path):
    path = draw_png(_two_ranks(), tmp_path / "t.png", title="two ranks")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
