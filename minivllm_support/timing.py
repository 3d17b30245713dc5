"""Timing variants fairly on a small, shared machine: warm up, take turns, report median and spread.

One un-warmed run of each variant is not a measurement: the first run pays the lazy set-up
(page faults, oneDNN kernels picked for new shapes), and a job starting beside us slows
whichever variant happens to run then. `compare` runs every variant once untimed, then lets
the variants take turns (A B C, A B C, ...) so that drift hits all of them alike, and keeps
every time. A variant that needs fresh state (a new engine) builds it inside its callable.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

LOADAVG = "/proc/loadavg"   # Linux; its 4th field counts the tasks runnable at this instant
BUSY_SHARE = 0.25           # warn when other tasks want this share of the cores (see busy_warning)


@dataclass
class Timing:
    """Every timed repeat of one variant, and what each repeat returned."""
    name: str
    seconds: list[float] = field(default_factory=list)
    results: list[object] = field(default_factory=list)

    @property
    def result(self) -> object:
        return self.results[-1]          # the last run's output, for the caller's checks and prints

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def spread(self) -> float:
        return max(self.seconds) - min(self.seconds)

    def describe(self) -> str:
        """'8.71 s (median of 3, 8.52-8.90 s)'."""
        if len(self.seconds) == 1:
            return f"{self.median:.2f} s (1 run)"
        return (f"{self.median:.2f} s (median of {len(self.seconds)}, "
                f"{min(self.seconds):.2f}-{max(self.seconds):.2f} s)")


def other_load(samples: int = 10, interval: float = 0.05) -> float:
    """How many tasks besides this one want a CPU now, averaged over samples x interval seconds.

    Sampled rather than the 1-minute load average, which also counts this process's own work
    so far and the tail of a script that just finished (a quiet machine would look busy).
    """
    counts = []
    try:
        for _ in range(samples):
            time.sleep(interval)         # lets our own torch threads go idle between samples
            with open(LOADAVG) as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)   # minus the reader itself
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]        # no /proc (macOS): the 1-minute average is the best we have
    return sum(counts) / len(counts)


def busy_warning() -> str | None:
    """A one-line warning when other work competes for the CPU, None when the machine is quiet.

    Threshold: other tasks wanting a quarter of the cores (half a core of 2). torch splits
    each operation across all cores and waits for its slowest thread, so a core taken even
    part of the time delays whole steps: that is how lesson 08 measured 0.68x beside a
    package install and 2.47x alone.
    """
    cores = os.cpu_count() or 1
    load = other_load()
    if load < BUSY_SHARE * cores:
        return None
    return (f"warning: the machine is busy ({load:.1f} other tasks wanted a CPU, {cores} cores; "
            f"load average {os.getloadavg()[0]:.2f}): the times below may be distorted")


def compare(variants: dict[str, Callable[[], object]], repeats: int = 3, warmup: bool = True,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time each variant `repeats` times, the variants taking turns, after one untimed run of each.

    Prints the busy warning (if any) first. `warmup=False` is for callers that ran a cheaper
    warm-up of their own because a full extra round would take too long. `clock` is for tests.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    warning = busy_warning()
    if warning:
        print(warning)
    if warmup:
        for run in variants.values():
            run()
    timings = {name: Timing(name) for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            t0 = clock()
            result = run()
            timings[name].seconds.append(clock() - t0)
            timings[name].results.append(result)
    return timings


def format_ratio(slow: Timing, fast: Timing, word: str = "faster") -> str:
    """'2.41x faster (median of 3, spread 2.30-2.55x)': median over median, and the range of
    the per-round ratios (each round's two runs were measured side by side)."""
    ratio = slow.median / fast.median
    if word == "faster" and ratio < 1:
        word = "faster, i.e. slower"     # say so plainly: "0.71x faster" reads like a gain
    head = f"{ratio:.2f}x{' ' + word if word else ''}"
    rounds = [s / f for s, f in zip(slow.seconds, fast.seconds)]
    if len(rounds) == 1:
        return f"{head} (1 run each)"
    return f"{head} (median of {len(rounds)}, spread {min(rounds):.2f}-{max(rounds):.2f}x)"
