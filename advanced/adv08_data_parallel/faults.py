"""Fault injection for the replicas, lesson 17's style, to test what the front end does.

    MINIVLLM_DP_FAULT=raise@40:1     replica 1's 40th forward raises (its requests fail, it goes on)
    MINIVLLM_DP_FAULT=dead@1         every forward of the last replica raises from the first: 3 faults
                                     and its engine is dead (lesson 18's rule), the replica exits
    MINIVLLM_DP_FAULT=hang@5:0       replica 0's 5th forward sleeps for an hour: the watchdog's case
"""
from __future__ import annotations

import time

from step18_benchmark.faults import FaultPlan, inject_faults

# "<kind>@<N>[:<replica>]": that replica (default: the last) at its N-th forward call.
FAULT_ENV = "MINIVLLM_DP_FAULT"


def parse_fault(value: str, index: int, num_replicas: int) -> tuple[str, int] | None:
    """(kind, call) when FAULT_ENV names this replica; a malformed value is an error, not ignored."""
    if not value:
        return None
    try:
        kind, rest = value.split("@", 1)
        call, _, who = rest.partition(":")
        call, who = int(call), int(who) if who else num_replicas - 1
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected <raise|dead|hang>@<call>[:<replica>]") from None
    if kind not in ("raise", "dead", "hang") or call < 1:
        raise ValueError(f"{FAULT_ENV}={value!r}: kind must be raise, dead or hang and call >= 1")
    return (kind, call) if who == index else None


class HangingRunner:
    """The runner part, but its `at`-th forward never returns (a stuck kernel, a deadlock)."""

    def __init__(self, runner, at: int):
        self.runner, self.at, self.calls = runner, at, 0

    def forward(self, *args):
        self.calls += 1
        if self.calls == self.at:
            time.sleep(3600)
        return self.runner.forward(*args)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def arm_fault(engine, fault: tuple[str, int] | None) -> None:
    if fault is None:
        return
    kind, call = fault
    if kind == "hang":
        engine.runner = HangingRunner(engine.runner, call)
    else:
        calls = {call} if kind == "raise" else set(range(call, call + 10_000))
        inject_faults(engine, FaultPlan(at_calls=calls))
