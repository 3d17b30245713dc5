"""An asynchronous front end: the engine loop in its own thread, one async token stream per request.

Lessons 09-17 drive the engine from one loop: add every request, then `step()` until done. A
server cannot work that way: requests arrive while others are running, each client wants
its tokens as they come, and some clients hang up. vLLM's AsyncLLM puts the engine loop
apart from the request handlers; this is the same shape on threads:

    event loop (asyncio)                          engine thread
    generate(prompt) --- inbox: add ------------> engine.add_request(...)   (between steps)
         ^                                         step() -> new tokens
         '---- queue.put(TokenEvent) <------------ loop.call_soon_threadsafe(...)
    client gone -------- inbox: abort ----------> abort(engine, seq): blocks freed

`AsyncEngine(engine, threaded=False)` swaps the two: `drive(fn)` runs the engine loop in the
calling thread and `fn` (the event loop) in a helper thread; on a CPU that keeps oneDNN's
matmuls in the main thread, where they are fastest (thread_cost.py).

Only the engine thread touches the engine: requests and aborts wait in the inbox until the
step in progress ends. An error inside `step()` ends the requests of that step only
(`StepFailed`); the others go on. If the block manager's books no longer balance, or faults
repeat (3 within 60 s), the engine is dead (`EngineDead`): every open stream hears of it,
new requests are refused, and `on_dead` is called (a server exits there). faults.py has the
rule and why it is safe.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence as Seq, TypeVar

from step06_sampler.params import SamplingParams
from step09_continuous_batching.sequence import Sequence
from step18_benchmark.faults import EngineDead, FaultPolicy, StepFailed, block_problems, end_request, step_requests

T = TypeVar("T")


@dataclass
class TokenEvent:
    token_id: int
    time: float                      # perf_counter when the engine produced it
    finished: bool = False
    finish_reason: str | None = None


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence | None = None
    aborted: bool = False
    done: bool = False


def abort(engine, seq: Sequence) -> None:
    """End `seq` now, wherever it is: waiting (never started, or preempted) or running. Its KV
    blocks go back to the pool through the scheduler's own `finish` (lesson 12)."""
    end_request(engine, seq, "abort")


class AsyncEngine:
    def __init__(self, engine, threaded: bool = True, policy: FaultPolicy | None = None,
                 on_dead: Callable[[EngineDead], None] | None = None):
        """engine: any engine of lessons 09-17 (its step() returns the sequences that got a token).

        threaded=False starts no engine thread: the caller drives the engine from its own
        (main) thread with `drive(fn)`, which runs `fn` (the event loop) in a helper thread.
        On a CPU that matters: oneDNN's matmuls called from a second thread ran at about one
        core's speed on a 2-core machine (`thread_cost.py`), so the engine loop belongs in
        the main thread, as in vLLM's engine-core process.

        policy: when faults stop being isolated (faults.py); on_dead: called once, in the
        engine thread, when the engine is declared dead."""
        self.engine = engine
        self.error: BaseException | None = None      # set once: the engine is dead
        self.policy, self.on_dead, self.faults = policy or FaultPolicy(), on_dead, 0
        self._inbox: deque[tuple[str, _Request]] = deque()
        self._live: dict[Sequence, _Request] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def drive(self, fn: Callable[[], T]) -> T:
        """Run `fn` (e.g. `lambda: asyncio.run(...)`) in a helper thread while this thread runs
        the engine loop; return what `fn` returned once it is done (or raise what it raised)."""
        if self._thread is not None:
            raise RuntimeError("this front end runs its own engine thread; call fn directly")
        result: list = []
        done = threading.Event()             # set before the wake-up: no race with the loop's check

        def target() -> None:
            try:
                result.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller below
                result.append((False, e))
            finally:
                done.set()
                self._wake.set()
        helper = threading.Thread(target=target, name="event-loop", daemon=True)
        helper.start()
        self._loop(until=done)
        helper.join()
        ok, value = result[0]
        if not ok:
            raise value
        return value

    # ---- the caller's side (event loop) ----------------------------------------------------
    async def generate(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens as the engine produces them. Leaving the loop early (break,
        cancellation, a client that hung up) aborts the request and frees its KV blocks."""
        if self.error is not None:
            raise EngineDead(f"the engine is dead and takes no requests: {self.error}")
        if self._stop:
            raise RuntimeError("the front end is shut down")
        req = _Request(list(prompt_ids), params or SamplingParams(), asyncio.get_running_loop(), asyncio.Queue())
        self._post("add", req)
        if self.error is not None:            # it died between the check above and the post
            raise EngineDead(f"the engine is dead and takes no requests: {self.error}")
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    req.done = True
                    return
        finally:
            if not req.done:
                self._post("abort", req)

    def _post(self, kind: str, req: _Request) -> None:
        self._inbox.append((kind, req))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self, until: threading.Event | None = None) -> None:
        """The engine loop; with `until`, it returns once that event is set and no work is left."""
        engine = self.engine
        while not self._stop:
            self._wake.clear()
            self._drain_inbox()
            if not engine.has_unfinished():
                if until is not None and until.is_set():
                    return
                self._wake.wait()
                continue
            try:
                sampled = engine.step()
            except BaseException as e:  # noqa: BLE001 - its requests must hear of it, and maybe all
                if self._after_fault(e):
                    return
                continue
            for seq in sampled:
                req = self._live.get(seq)
                if req is None:
                    continue
                event = TokenEvent(seq.token_ids[-1], seq.token_times[-1], seq.is_finished, seq.finish_reason)
                req.loop.call_soon_threadsafe(req.queue.put_nowait, event)
                if seq.is_finished:
                    del self._live[seq]
        stopped = RuntimeError("the front end was shut down before this request finished")
        for req in self._live.values():
            req.loop.call_soon_threadsafe(req.queue.put_nowait, stopped)

    def _after_fault(self, error: BaseException) -> bool:
        """A step raised: end the requests it held, check the books, count the fault.
        True when the engine is now dead. The verdict comes before anyone is told, so a
        caller that hears of the fault already sees the engine's new state."""
        self.faults += 1
        failed = step_requests(self.engine)
        if failed is None:                    # it raised before a batch existed: all in flight
            failed = list(self._live)
        told = []
        for seq in failed:
            try:
                end_request(self.engine, seq, "error")
            except Exception:  # noqa: BLE001 - the books check below judges what is left
                pass
            if seq in self._live:
                told.append(self._live.pop(seq))
        why = None
        if not isinstance(error, Exception):
            why = f"interrupted ({type(error).__name__})"
        elif getattr(self.engine, "closed", False):
            why = "the engine closed itself (lesson 17: a worker failed)"
        elif problems := block_problems(self.engine):
            why = "the block manager's books do not balance: " + "; ".join(problems[:3])
        elif self.policy.record():
            why = f"{self.policy.max_faults} faults within {self.policy.window_s:.0f} s"
        dead = None if why is None else EngineDead(f"engine dead: {why}; last fault: {type(error).__name__}: {error}")
        if dead is not None:
            self.error = dead
            if self.on_dead is not None:
                self.on_dead(dead)
        step_error = StepFailed(f"an engine step failed, and this request was in it: "
                                f"{type(error).__name__}: {error}")
        for req in told:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, step_error)
        if dead is None:
            return False
        for req in self._live.values():
            req.loop.call_soon_threadsafe(req.queue.put_nowait, dead)
        self._live.clear()
        while self._inbox:                    # posted but never admitted: they hear it too
            kind, req = self._inbox.popleft()
            if kind == "add":
                req.loop.call_soon_threadsafe(req.queue.put_nowait, dead)
        return True

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, req = self._inbox.popleft()
            if kind == "abort":
                req.aborted = True
                if req.seq is not None and req.seq in self._live:
                    abort(self.engine, req.seq)
                    del self._live[req.seq]
                continue
            if req.aborted:
                continue
            try:
                req.seq = self.engine.add_request(req.prompt_ids, req.params)
            except Exception as e:  # noqa: BLE001 - a bad request: its caller gets the error, others go on
                req.loop.call_soon_threadsafe(req.queue.put_nowait, e)
                continue
            self._live[req.seq] = req


async def collect(front: AsyncEngine, prompt_ids: Seq[int], params: SamplingParams) -> list[int]:
    """All the tokens of one request (what `engine.generate` returns, through the front end)."""
    return [event.token_id async for event in front.generate(prompt_ids, params)]
