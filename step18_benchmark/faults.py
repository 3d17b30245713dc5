"""When one engine step fails: whom it takes down, what is checked, and when the engine is dead.

A step that raises has touched only what it scheduled:

    step N: schedule -> forward (writes K/V) -> logits -> sample -> count computed -> cache full blocks
                        ^ a fault here         ^ or here
    K/V written:   only the slots of the tokens this step computes, in blocks of the step's own
                   sequences. A block shared through the prefix cache is full and already
                   computed, so no step writes into it again.
    prefix cache:  a block is named (hashed) only after its tokens count as computed, which is
                   after the forward; a half-written block is never named, so no later request
                   can hit it.

So the rule (what `AsyncEngine` does, frontend.py): the requests in the failed step end with
the error (their blocks go back to the pool); every other request keeps its state and goes on.
Then the block manager's books are checked (`block_problems`). If they do not balance, or
faults repeat (`FaultPolicy`: 3 within 60 s), nothing is trusted any more: the engine is dead,
every open request gets `EngineDead`, and a server exits so that a supervisor restarts it.

Fault injection is a lesson tool: `inject_faults(engine, FaultPlan(...))` wraps the engine's
runner part in a `FaultyRunner`, which raises `InjectedFault` on the calls or sequences the plan
names. An engine built without it runs its own runner, with nothing of this on its path.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence, SequenceStatus


class InjectedFault(RuntimeError):
    """Raised by a FaultyRunner where its plan says: a stand-in for a real bug or a bad kernel."""


class StepFailed(RuntimeError):
    """This request was in an engine step that raised; the engine went on without it (HTTP 500)."""


class EngineDead(RuntimeError):
    """The engine can no longer be trusted (books do not balance, repeated faults, lost workers);
    every open request ends with this (HTTP 503) and a server exits."""


# ---- injecting faults -----------------------------------------------------------------------
@dataclass
class FaultPlan:
    """Which forward calls raise: the `at_calls`-th ones (1-based, counted by the runner), and
    any whose batch holds a sequence that `when` picks. `after_forward`: run the real forward
    first (its K/V writes happen), then raise, the harder case for the rule above."""
    at_calls: set[int] = field(default_factory=set)
    when: Callable[[Sequence], bool] | None = None
    after_forward: bool = False


class FaultyRunner:
    """A runner part that raises where its plan says and otherwise is the runner it wraps."""

    def __init__(self, runner, plan: FaultPlan):
        self.runner, self.plan, self.calls, self.raised = runner, plan, 0, 0

    def forward(self, batch: ScheduledBatch, input_ids, positions, attn):
        self.calls += 1
        picked = [s.seq_id for s in batch.seqs if self.plan.when is not None and self.plan.when(s)]
        fault = self.calls in self.plan.at_calls or bool(picked)
        out = self.runner.forward(batch, input_ids, positions, attn) if not fault or self.plan.after_forward else None
        if fault:
            self.raised += 1
            why = f"sequence(s) {picked}" if picked else f"call {self.calls}"
            raise InjectedFault(f"injected fault in forward call {self.calls} ({why}; FaultPlan)")
        return out

    def __getattr__(self, name: str):          # compute_logits, close, replays, ...: the wrapped runner's
        return getattr(self.runner, name)


def inject_faults(engine, plan: FaultPlan) -> FaultyRunner:
    """Wrap `engine.runner` (lesson 15's part) so that the steps the plan names raise."""
    if not hasattr(engine, "runner"):
        raise TypeError(f"{type(engine).__name__} has no runner part: fault injection needs lesson 15's "
                        "Engine or a later one")
    engine.runner = FaultyRunner(engine.runner, plan)
    return engine.runner


def prompt_contains(marker: str, decode: Callable[[list[int]], str]) -> Callable[[Sequence], bool]:
    """A `when` for FaultPlan: sequences whose prompt text holds `marker` (decoded once per
    sequence and remembered, since the runner asks at every step). The server's
    `--fault-marker` uses it, so a soak can make a step fail on purpose."""
    if not marker:
        raise ValueError("the fault marker must be a non-empty string")
    seen: dict[int, bool] = {}

    def when(seq: Sequence) -> bool:
        if seq.seq_id not in seen:
            if len(seen) > 4096:              # a server runs for days: forget old sequences
                seen.clear()
            seen[seq.seq_id] = marker in decode(seq.token_ids[:seq.num_prompt_tokens])
        return seen[seq.seq_id]
    return when


# ---- after a fault --------------------------------------------------------------------------
def step_requests(engine) -> list[Sequence] | None:
    """The sequences the failed step scheduled (lesson 15's Engine keeps `current_batch` for
    the step in progress); None when the fault came before a batch existed (in schedule())."""
    batch = getattr(engine, "current_batch", None)
    return None if batch is None else list(batch.seqs)


def end_request(engine, seq: Sequence, reason: str) -> None:
    """Finish `seq` now, wherever it is (waiting or running); its KV blocks go back to the pool."""
    if seq.is_finished:
        return
    scheduler = engine.scheduler
    if seq in scheduler.waiting:
        scheduler.waiting.remove(seq)
        if getattr(seq, "block_table", None) and hasattr(scheduler, "block_manager"):
            scheduler.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
    else:
        scheduler.finish(seq, reason)


def block_problems(engine) -> list[str]:
    """What is wrong with the block manager's books, [] when they balance:
    every block is free xor referenced, free + used = total, no block is on the free list
    twice, and each block's ref count equals the number of live block tables that hold it."""
    scheduler = engine.scheduler
    bm = getattr(scheduler, "block_manager", None)
    if bm is None:
        return []                                          # lessons 09-11: no shared blocks to check
    problems = []
    free = list(bm.free_block_ids)
    if len(free) != len(set(free)):
        twice = sorted(b for b, c in Counter(free).items() if c > 1)
        problems.append(f"blocks on the free list twice: {twice[:8]}")
    free_set = set(free)
    live = [s for s in list(scheduler.running) + list(scheduler.waiting) if not s.is_finished]
    held = Counter(b for s in live for b in (s.block_table or []))
    used = 0
    for block in bm.blocks:
        b, refs = block.block_id, block.ref_count
        used += refs > 0
        if refs != held[b]:
            problems.append(f"block {b}: ref_count {refs}, but {held[b]} live block table(s) hold it")
        if (b in free_set) == (refs > 0):
            problems.append(f"block {b}: ref_count {refs} and {'on' if b in free_set else 'not on'} the free list")
    if used + len(free_set) != bm.num_blocks:
        problems.append(f"free {len(free_set)} + used {used} != total {bm.num_blocks}")
    unknown = set(held) - set(range(bm.num_blocks))
    if unknown:
        problems.append(f"block tables hold ids outside the pool: {sorted(unknown)[:8]}")
    return problems[:20]


@dataclass
class FaultPolicy:
    """When faults stop being isolated: `max_faults` within `window_s` seconds make the engine
    dead (vLLM's engine core dies on the first; one bad request should not take all down)."""
    max_faults: int = 3
    window_s: float = 60.0
    times: deque = field(default_factory=deque)

    def record(self, now: float | None = None) -> bool:
        """Count one fault; True when this one makes the engine dead."""
        now = time.monotonic() if now is None else now
        self.times.append(now)
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        return len(self.times) >= self.max_faults
