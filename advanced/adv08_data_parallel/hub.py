"""The collector side of the data-parallel front end: what is in flight where, and who hears what.

    event loop: submit(pend) --lock--> router picks i --> replicas[i].live[rid] = pend --> its connection
    collector thread:  wait(every replica's connection, 0.2 s)
        ("event", rid, ...)  -> pend's queue (via its event loop), the replica's load updated
        ("error", rid, ...)  -> the same class of error (StepFailed, EngineDead, ...) to pend
        EOF                  -> _died(): every pend of that replica is re-routed or told
        nothing for hang_timeout_s with work -> ask for its stack, then kill it (EOF follows);
                                a replica on another machine: hang up its socket instead

Everything a request needs to hear of is in `live` under one lock, so a replica that goes away
can account for each of its requests: none is ever left waiting on a queue nobody feeds.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import multiprocessing as mp
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from advanced.adv08_data_parallel.router import ReplicaLoad, Router
from step14_batched_forward.engine import EngineStats
from step17_tensor_parallel.workers import shutdown
from step18_benchmark.faults import EngineDead, StepFailed
from step19_real_model.params import SamplingParams

# A replica's error crosses the connection as its class name and is raised here as the same class, so
# lesson 20's API answers it as it would for one engine (StepFailed 500, EngineDead 503, ValueError 400).
ERRORS = {"StepFailed": StepFailed, "EngineDead": EngineDead, "ValueError": ValueError, "TypeError": TypeError}


@dataclass(eq=False)
class Pending:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    replica: int = -1
    rid: int = -1
    tokens: int = 0
    rerouted: bool = False


class Reroute:
    """Put on a request's queue: its replica died before it produced a token; submit it again."""


@dataclass(eq=False)
class ReplicaHandle:
    index: int
    proc: mp.Process | None             # None: it runs on another node; only its socket is here
    conn: Connection
    node: int = 0
    pid: int = 0                        # its own, as it reported it (on its own machine)
    live: dict[int, Pending] = field(default_factory=dict)
    stats: EngineStats | None = None
    alive: bool = True
    last_heard: float = 0.0
    account: str | None = None          # what the replica said before it went (a traceback, ...)
    asked_at: float | None = None       # when the watchdog asked it for its stack
    stack: str | None = None
    timeline: dict | None = None        # its last Timeline.to_dict(), when asked for one
    offset_ns: int = 0                  # add to its clock to get the front end's (measured at start)
    lock: threading.Lock = field(default_factory=threading.Lock)   # one writer at a time on the connection

    def load(self) -> ReplicaLoad:
        s = self.stats
        # A replica with an account (its engine died, or the watchdog is stopping it) takes no
        # more requests, even before its connection reaches EOF.
        return ReplicaLoad(len(self.live), s.num_running if s else 0,
                           s.kv_blocks_used / max(1, s.kv_blocks_total) if s else 0.0,
                           self.alive and self.account is None)

    def send(self, msg: tuple, block: bool = True) -> None:
        """block=False (the watchdog): skip if another send is stuck on a full socket buffer, which a
        replica that stopped reading leaves behind; the kill that follows unsticks it."""
        if not self.lock.acquire(blocking=block):
            return
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            pass                        # it is gone; the collector sees the EOF and acts on it
        finally:
            self.lock.release()


class ReplicaHub:
    """Everything the collector thread touches. It holds no reference to the DPFrontEnd, so an
    unreachable front end is garbage-collected and its finalizer stops the replicas."""

    def __init__(self, replicas: list[ReplicaHandle], router: Router, hang_timeout_s: float):
        self.replicas, self.router, self.hang_timeout_s = replicas, router, hang_timeout_s
        self.lock = threading.Lock()
        self.error: EngineDead | None = None
        self.closing = False
        self.ids = itertools.count()
        self.routed = [0] * len(replicas)               # requests sent to each replica, ever
        self.thread = threading.Thread(target=self.collect, name="dp-collector", daemon=True)

    # ---- the event loop's side ---------------------------------------------------------------
    def submit(self, pend: Pending) -> None:
        with self.lock:
            if self.error is not None:
                raise EngineDead(f"no replica is alive: {self.error}")
            if self.closing:
                raise RuntimeError("the data-parallel front end is shut down")
            i = self.router.route(pend.prompt_ids, [r.load() for r in self.replicas])
            rep = self.replicas[i]
            if not rep.live:
                rep.last_heard = time.monotonic()       # the hang clock starts with the work
            pend.replica, pend.rid = i, next(self.ids)
            self.routed[i] += 1
            rep.live[pend.rid] = pend
            rep.send(("add", pend.rid, pend.prompt_ids, pend.params))

    def abort(self, pend: Pending) -> None:
        with self.lock:
            rep = self.replicas[pend.replica]
            if rep.live.pop(pend.rid, None) is not None and rep.alive:
                rep.send(("abort", pend.rid))

    # ---- the collector thread ----------------------------------------------------------------
    def collect(self) -> None:
        while not self.closing:
            conns = {r.conn: r for r in self.replicas if r.alive}
            if not conns:
                return
            for conn in wait(list(conns), timeout=0.2):
                rep = conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if not self.closing:
                        self._died(rep)
                    continue
                self._handle(rep, msg)
            self._watch()

    def _handle(self, rep: ReplicaHandle, msg: tuple) -> None:
        kind = msg[0]
        if kind == "dead":
            rep.account = msg[1]
        elif kind == "stack":
            rep.stack = msg[1]
        elif kind == "timeline":
            rep.timeline = msg[1]
        elif kind in ("event", "error"):
            with self.lock:
                rep.stats, rep.last_heard = msg[-1], time.monotonic()
                pend = rep.live.get(msg[1])
                if pend is None:
                    return                               # aborted meanwhile
                if kind == "error":
                    item = ERRORS.get(msg[2], RuntimeError)(f"replica {rep.index}: {msg[3]}")
                else:
                    item, pend.tokens = (msg[2], msg[3]), pend.tokens + 1
                if kind == "error" or msg[2].finished:
                    del rep.live[msg[1]]
            pend.loop.call_soon_threadsafe(pend.queue.put_nowait, item)

    def _watch(self) -> None:
        """A replica with work that has been silent too long: ask where it is, then stop it."""
        now = time.monotonic()
        for rep in self.replicas:
            if not rep.alive or not rep.live or now - rep.last_heard <= self.hang_timeout_s:
                continue
            if rep.asked_at is None:
                rep.asked_at = now
                rep.send(("stack",), block=False)
            elif rep.stack is not None or now - rep.asked_at > 1.0:
                silent = now - rep.last_heard
                rep.account = (f"replica {rep.index} (pid {rep.pid}) hung: no token for {silent:.1f} s "
                               f"with {len(rep.live)} request(s) in flight; it was stopped. Its engine "
                               f"thread was at:\n{rep.stack or '(it did not answer)'}")
                self._stop(rep)                          # its connection ends: _died() follows

    @staticmethod
    def _stop(rep: ReplicaHandle) -> None:
        if rep.proc is not None:
            rep.proc.kill()
            return
        # Not ours to kill: end the connection both ways. The replica reads EOF and stops serving;
        # the collector reads EOF and accounts for its requests. (A dup: the Connection keeps its fd.)
        try:
            with socket.socket(fileno=os.dup(rep.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _died(self, rep: ReplicaHandle) -> None:
        if rep.proc is None:
            how = f"node {rep.node}: connection lost, its process or machine is gone"
        else:
            rep.proc.join(1.0)
            if rep.proc.exitcode is None:        # its connection is gone but it is not: no orphan
                rep.proc.kill()
                rep.proc.join(1.0)
            code = rep.proc.exitcode
            how = ("did not exit" if code is None else f"killed by signal {signal.Signals(-code).name}"
                   if code < 0 else f"exit code {code}")
        account = rep.account or f"replica {rep.index} (pid {rep.pid}) ended ({how}) without a word"
        with self.lock:
            rep.alive = False
            self.router.forget(rep.index)
            others = any(r.alive for r in self.replicas)
            told = list(rep.live.values())
            rep.live.clear()
            if not others:
                self.error = EngineDead(f"every replica is dead; the last: {account}")
        for pend in told:
            again = others and pend.tokens == 0 and not pend.rerouted
            pend.rerouted |= again
            item = Reroute() if again else EngineDead(f"replica {rep.index} died with this request in "
                                                       f"flight: {account}")
            pend.loop.call_soon_threadsafe(pend.queue.put_nowait, item)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self, wait_s: float = 5.0) -> None:
        self.closing = True
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(2.0)
        # Remote replicas hear the same stop message and end; their node's process then exits.
        shutdown([r.proc for r in self.replicas if r.proc is not None], [r.conn for r in self.replicas], wait_s)
        stopped = RuntimeError("the data-parallel front end was shut down before this request finished")
        with self.lock:
            told = [p for r in self.replicas for p in r.live.values()]
            for r in self.replicas:
                r.live.clear()
        for pend in told:
            try:
                pend.loop.call_soon_threadsafe(pend.queue.put_nowait, stopped)
            except RuntimeError:                         # its event loop is gone already
                pass
