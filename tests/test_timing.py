"""minivllm_support.timing: warm-up untimed, variants take turns, median and spread, the busy warning."""
from __future__ import annotations

import os

import pytest

from minivllm_support import timing
from minivllm_support.timing import Timing, busy_warning, compare, format_ratio


@pytest.fixture
def quiet(monkeypatch):
    """No sampling sleeps and no warning: compare's tests are about order and arithmetic."""
    monkeypatch.setattr(timing, "other_load", lambda: 0.0)


class FakeClock:
    """A clock that only moves when a fake variant says how long it 'took'."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def variant(name: str, calls: list[str], clock: FakeClock, durations: list[float]):
    """A callable that logs its call, 'takes' its next duration on the clock, returns 'name#k'."""
    done = 0

    def run() -> str:
        nonlocal done
        calls.append(name)
        clock.now += durations[done]
        done += 1
        return f"{name}#{done}"
    return run


def test_warmup_untimed_then_variants_take_turns(quiet):
    calls, clock = [], FakeClock()
    runs = compare({n: variant(n, calls, clock, [100.0, 1.0, 2.0, 3.0]) for n in "ABC"},
                   repeats=3, clock=clock)
    assert calls == list("ABC") + list("ABC") * 3          # one warm-up each, then A B C, A B C, ...
    for t in runs.values():
        assert t.seconds == [1.0, 2.0, 3.0]                  # the 100 s warm-up is not among them
    assert runs["B"].results == ["B#2", "B#3", "B#4"] and runs["B"].result == "B#4"


def test_without_warmup_the_first_run_counts(quiet):
    calls, clock = [], FakeClock()
    runs = compare({"A": variant("A", calls, clock, [5.0, 1.0])}, repeats=2, warmup=False, clock=clock)
    assert calls == ["A", "A"] and runs["A"].seconds == [5.0, 1.0]


def test_median_spread_best():
    t = Timing("x", [3.0, 1.0, 2.5, 10.0, 2.0])
    assert (t.median, t.best, t.spread) == (2.5, 1.0, 9.0)
    assert t.describe() == "2.50 s (median of 5, 1.00-10.00 s)"
    assert Timing("y", [4.0]).describe() == "4.00 s (1 run)"


def test_format_ratio_is_median_over_median_with_per_round_spread():
    slow, fast = Timing("slow", [10.0, 12.0, 9.0]), Timing("fast", [4.0, 5.0, 4.5])
    # 10 / 4.5 = 2.22; rounds 10/4 = 2.5, 12/5 = 2.4, 9/4.5 = 2.0
    assert format_ratio(slow, fast) == "2.22x faster (median of 3, spread 2.00-2.50x)"
    assert format_ratio(slow, fast, word="") == "2.22x (median of 3, spread 2.00-2.50x)"
    assert format_ratio(Timing("a", [3.0]), Timing("b", [2.0])) == "1.50x faster (1 run each)"
    assert format_ratio(Timing("a", [2.0]), Timing("b", [4.0])) == "0.50x faster, i.e. slower (1 run each)"


def test_repeats_must_be_positive(quiet):
    with pytest.raises(ValueError, match="repeats"):
        compare({"A": lambda: None}, repeats=0)


def test_busy_warning_from_runnable_tasks(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(timing, "LOADAVG", str(loadavg))
    loadavg.write_text("1.90 1.00 0.50 1/99 1234\n")       # only the reader runs: quiet, whatever the average
    assert busy_warning() is None
    loadavg.write_text("1.90 1.00 0.50 3/99 1234\n")       # two others want a CPU on 2 cores
    line = busy_warning()
    assert line is not None and "busy" in line and "2.0 other tasks" in line and "1.90" in line


def test_busy_warning_falls_back_to_the_load_average(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(timing, "LOADAVG", str(tmp_path / "missing"))   # no /proc, as on macOS
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert busy_warning() is None                                        # 0.5 < 0.25 x 4 cores
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert "load average 1.50" in busy_warning()


def test_compare_prints_the_warning_once_before_timing(monkeypatch, capsys):
    monkeypatch.setattr(timing, "busy_warning", lambda: "warning: busy")
    order = []
    compare({"A": lambda: order.append(capsys.readouterr().out)}, repeats=2)
    assert order[0] == "warning: busy\n"                     # printed before the first (warm-up) run
    assert capsys.readouterr().out == ""                     # and not again
