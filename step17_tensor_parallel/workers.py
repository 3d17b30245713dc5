"""Rank 0's handle on the other ranks: the ones it spawned, and a connection to every one.

    ws = WorkerSet(launch, world)            host the store (or join torchrun's), open the control port
    ws.spawn(rank, target, spec)             for each rank of node 0 (none under torchrun)
    ws.accept(flags)                         every rank dialled in with the same flags, or an error
    ... send steps over ws.conns ...
    ws.report()                              what the workers say: tracebacks, exit codes, lost nodes
    ws.release()                             stop them all (also run by a finalizer if you forget)

Lesson 17's TPEngine starts its ranks through it, and so do the engines of the advanced lessons
that split a model over processes: the rendezvous, the flag check, the fault report and the
shutdown are written once, and every engine works across machines the same way.
"""
from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch.multiprocessing as mp

from step17_tensor_parallel import control, parallel
from step17_tensor_parallel.launch import NodeLaunch


class WorkerFailed(RuntimeError):
    """A worker raised, died or stopped answering; the engine is closed."""


def shutdown(procs: list, conns: list[Connection], wait_s: float = 5.0) -> None:
    """Ask every worker to stop (an empty message), then make sure: terminate, then kill."""
    for conn in conns:
        try:
            conn.send_bytes(b"")
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(wait_s)
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()


class WorkerSet:
    def __init__(self, launch: NodeLaunch, world: int, name: str = "tp", what: str = "tensor-parallel"):
        """name: the process-name prefix ("tp" -> "tp-rank-1"); what: how errors call the workers."""
        if launch.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {launch.node_rank} runs headless workers")
        self.launch, self.world, self.name, self.what = launch, world, name, what
        self.procs: list = []                  # the processes this one spawned (node 0's ranks)
        self.conns: list[Connection] = []      # one per worker rank, in self.ranks' order
        self.ranks: list[int] = []
        try:
            self.store = parallel.make_store(0, world, launch.master_port, launch.rendezvous_timeout_s,
                                             launch.master_addr, is_master=not launch.torchrun)
        except Exception as e:  # noqa: BLE001 - a port in use, an address not of this machine
            raise RuntimeError(f"cannot host the rendezvous on port {launch.master_port}: {e}") from e
        self._server = control.ControlServer(self.store)

    @property
    def port(self) -> int:
        return self.store.port

    def local_ranks(self) -> list[int]:
        """The ranks rank 0 starts itself: the rest of node 0 (none under torchrun, which started them)."""
        return [] if self.launch.torchrun else [r for r in self.launch.local_ranks(self.world) if r != 0]

    def spawn(self, rank: int, target, spec) -> None:
        ctx = mp.get_context("spawn")          # fresh interpreters: no forked torch thread pools
        proc = ctx.Process(target=target, args=(spec,), name=f"{self.name}-rank-{rank}", daemon=True)
        proc.start()
        self.procs.append(proc)

    def node_of(self, rank: int) -> int:
        """The node a rank runs on (launch.py's rule; an engine with another placement overrides it)."""
        return self.launch.node_of(rank, self.world)

    def accept(self, flags: control.RunFlags) -> None:
        conns = self._server.accept_all(list(range(1, self.world)), flags, self.launch.rendezvous_timeout_s,
                                        self.node_of, self.check_alive)
        self.ranks += sorted(conns)
        self.conns += [conns[r] for r in self.ranks]

    # ---- health --------------------------------------------------------------------------
    def proc(self, rank: int):
        return next((p for p in self.procs if p.name == f"{self.name}-rank-{rank}"), None)

    def check_alive(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                raise WorkerFailed(f"{self.what} {p.name} exited with code {p.exitcode}")

    def wait_ready(self, timeout_s: float = 600.0) -> list[dict]:
        """Each worker's ("ready", facts) after it loaded its part, in rank order. A worker on another
        machine that stays silent (alive, connected, stuck loading) fails after timeout_s."""
        deadline = time.monotonic() + timeout_s
        return [self._ready(conn, rank, deadline) for conn, rank in zip(self.conns, self.ranks)]

    def _ready(self, conn: Connection, rank: int, deadline: float) -> dict:
        proc = self.proc(rank)
        while True:
            if time.monotonic() > deadline:
                raise WorkerFailed(f"{self.what} rank {rank} did not finish starting (loading its part) in time")
            try:
                if conn.poll(0.1):
                    kind, info = conn.recv()
                    if kind == "error":
                        raise WorkerFailed(f"{self.what} worker failed while starting:\n{info}")
                    return info
            except (EOFError, OSError) as e:
                raise WorkerFailed(f"{self.what} rank {rank} closed its connection while starting") from e
            if proc is not None and not proc.is_alive():
                raise WorkerFailed(f"{self.what} rank {rank} exited with code {proc.exitcode} while starting")

    def report(self) -> str:
        """What the workers say about themselves: their tracebacks, or how they ended. A rank on
        another machine has no process handle here: its connection tells whether it is gone."""
        lines = []
        for conn, rank in zip(self.conns, self.ranks):
            proc = self.proc(rank)
            try:
                if conn.poll(0.05):   # a worker that raised wrote this before it exited
                    kind, info = conn.recv()
                    if kind == "error":
                        lines.append(info.rstrip())
                        continue
            except (EOFError, OSError):
                if proc is None:
                    node = self.node_of(rank)
                    lines.append(f"rank {rank} (node {node}): connection lost: its process or machine is gone")
                    continue
            if proc is None:
                continue
            proc.join(0.05)
            if proc.exitcode is None:
                lines.append(f"rank {rank}: still running but not answering (stopped now)")
            elif proc.exitcode:
                how = f"killed by signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit code {proc.exitcode}"
                lines.append(f"rank {rank}: process ended ({how})")
        return "\n".join(lines)

    def release(self, wait_s: float = 5.0) -> None:
        shutdown(self.procs, self.conns, wait_s)
