"""The data-parallel front end: N replica processes, one router, one collector thread.

    stream(prompt) --router--> replica i --conn--> ("add", rid, ids, params)
         ^                                                  |  replica i's engine steps
         '--- queue <-- collector thread <--conn-- ("event", rid, token, logprobs, stats)
                          |  every 0.2 s: a replica with requests in flight that has said
                          |  nothing for hang_timeout_s is asked for its stack, then killed
                          '  a conn at EOF: the replica is gone -> its requests are re-routed
                             (no token yet) or fail with EngineDead and its own account

Where the replicas run (lesson 18's launch.py, control.py, workers.py): the front end is rank 0
and hosts the rendezvous; replica i is rank i+1 and dials it, on this machine or another.

    node 0: front end (rank 0) + replicas 0..k-1        node r: python -m advanced.adv08_data_parallel.node
            spawned here, they dial 127.0.0.1                   replicas r*k..r*k+k-1 dial node 0
    k = N / nnodes replicas per node (vLLM: --data-parallel-size-local)

It has the shape lesson 21's AsyncLLM drives (`stream`, `error`, `shutdown`) and lesson 19's
load generator drives (`generate`, `threaded`), so both sit on top unchanged.

Failures, by lesson 19's rules (faults.py): a failed step on a replica ends that step's
requests with StepFailed (HTTP 500) and the replica goes on; a replica whose engine is dead,
that exits, is killed, or hangs, takes only its own requests down: those with no token yet go
to another replica (the client saw nothing, so nothing is repeated; once only, in case the
request itself is what kills replicas), the others end with EngineDead (503) naming the
replica and what it said. New requests go to the live replicas; with none left, EngineDead.
The collector's side of this (who is in flight where, who hears what) is pool.py.
"""
from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

import torch

from advanced.adv08_data_parallel.pool import Pending, ReplicaHandle, ReplicaPool, Reroute
from advanced.adv08_data_parallel.replica import ReplicaSpec, replica_main
from advanced.adv08_data_parallel.router import CacheAware, Router, create_router
from minivllm_support.models import resolve_model
from minivllm_support.timeline import Timeline
from step14_batched_forward.engine import EngineStats
from step18_tensor_parallel.launch import NodeLaunch
from step18_tensor_parallel.workers import WorkerSet
from step19_benchmark.faults import EngineDead
from step19_benchmark.frontend import TokenEvent
from step20_real_model.params import SamplingParams


def replicas_per_node(num_replicas: int, launch: NodeLaunch) -> int:
    if num_replicas % launch.nnodes:
        raise ValueError(f"--data-parallel-size {num_replicas} does not split evenly over --nnodes {launch.nnodes}")
    return num_replicas // launch.nnodes


def local_replicas(num_replicas: int, launch: NodeLaunch) -> list[int]:
    """The replica indices this node runs (rank = index + 1; rank 0 is the front end)."""
    k = replicas_per_node(num_replicas, launch)
    return list(range(launch.node_rank * k, launch.node_rank * k + k))


class ReplicaSet(WorkerSet):
    """Lesson 18's WorkerSet with the data-parallel placement: nodes named by replicas_per_node,
    because world = N + 1 (the front end) rarely splits evenly over nodes."""

    def node_of(self, rank: int) -> int:
        return 0 if rank == 0 else (rank - 1) // replicas_per_node(self.world - 1, self.launch)


class DPFrontEnd:
    """N engine replicas behind one router; `with DPFrontEnd(...) as front:` or close()."""
    threaded = True                  # the engines run elsewhere: callers just await
    _thread = None                   # (what lesson 21's AsyncLLM.healthy looks at)

    def __init__(self, model: str | Path | None = None, num_replicas: int = 2, policy: str = "cache_aware", *,
                 dtype: torch.dtype = torch.float32, threads_per_replica: int = 1, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_cache_bytes: int = 128 * 2**20,
                 enforce_eager: bool = True, hang_timeout_s: float = 30.0, start_timeout_s: float = 120.0,
                 trace: bool = False, launch: NodeLaunch | None = None, **router_options):
        """policy, router_options: router.create_router's; checked before any process starts.
        launch: lesson 18's NodeLaunch (default: every replica on this machine); with nnodes > 1,
        this is node 0 and the other nodes run `python -m advanced.adv08_data_parallel.node`.
        hang_timeout_s: a replica with requests that sends nothing for this long is stopped.
        trace: each replica records its engine steps; `timelines()` collects them."""
        if hang_timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s and start_timeout_s must be > 0, got {hang_timeout_s}, {start_timeout_s}")
        self.set_policy(policy, num_replicas, **router_options)        # checked before any process starts
        self.model_dir = resolve_model(model)
        launch = launch or NodeLaunch()
        here = local_replicas(num_replicas, launch)                    # checks N against --nnodes, too
        ws = ReplicaSet(launch, num_replicas + 1, name="dp", what="data-parallel replica")
        try:
            spec = ReplicaSpec(0, num_replicas, str(self.model_dir), dtype, threads_per_replica, max_num_seqs,
                               max_num_batched_tokens, kv_cache_bytes, enforce_eager, trace,
                               master_addr="127.0.0.1" if not launch.multi_node else launch.master_addr,
                               port=ws.port, nnodes=launch.nnodes,
                               rendezvous_timeout_s=launch.rendezvous_timeout_s)
            for i in here:
                ws.spawn(i + 1, replica_main, replace(spec, index=i))
            ws.accept(spec.flags())           # every replica, from every node, with node 0's flags
        except BaseException:
            ws.release(wait_s=0.5)
            raise
        replicas = [ReplicaHandle(rank - 1, ws.proc(rank), conn, node=ws.node_of(rank))
                    for rank, conn in zip(ws.ranks, ws.conns)]
        self._pool = ReplicaPool(replicas, self.router, hang_timeout_s)
        # Runs at garbage collection or at interpreter exit, unless close() ran first.
        self._finalizer = weakref.finalize(self, self._pool.close)
        try:
            self.facts = [self._wait_ready(r, start_timeout_s) for r in replicas]
        except BaseException:
            self.close(wait_s=0.5)
            raise
        for r, f in zip(replicas, self.facts):
            r.pid = f["pid"]
        self.pool_tokens = min(f["num_blocks"] * f["block_size"] for f in self.facts)
        self.set_policy(policy, num_replicas, **router_options)         # now it can size its trees
        self._pool.thread.start()

    def set_policy(self, policy: str, num_replicas: int | None = None, **router_options) -> Router:
        """A fresh router (run.py compares policies on the same replicas). A cache-aware router's
        trees hold as many tokens as one replica's KV pool unless tree_tokens says otherwise."""
        pool = getattr(self, "_pool", None)
        n = num_replicas or len(pool.replicas)
        if pool is not None and any(r.live for r in pool.replicas):
            raise RuntimeError("set_policy: requests are in flight; change the policy between runs")
        if policy == CacheAware.name and hasattr(self, "pool_tokens"):
            router_options.setdefault("tree_tokens", self.pool_tokens)
        self.router = create_router(policy, n, **router_options)
        for i, alive in enumerate(self.alive() if pool is not None else []):
            if not alive:
                self.router.forget(i)
        if pool is not None:
            pool.router = self.router
        return self.router

    def _wait_ready(self, rep: ReplicaHandle, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if rep.conn.poll(0.1):
                try:
                    kind, info = rep.conn.recv()
                except (EOFError, OSError):          # it ended without a word (killed, os._exit)
                    if rep.proc is None:
                        raise RuntimeError(f"replica {rep.index} (node {rep.node}) hung up while starting") from None
                    rep.proc.join(1.0)
                    raise RuntimeError(f"replica {rep.index} exited with code {rep.proc.exitcode} "
                                       f"while starting") from None
                if kind == "ready":
                    return info
                raise RuntimeError(f"replica {rep.index} failed while starting: {info}")
            if rep.proc is not None and not rep.proc.is_alive() and not rep.conn.poll(0):
                raise RuntimeError(f"replica {rep.index} exited with code {rep.proc.exitcode} while starting")
        raise RuntimeError(f"replica {rep.index} (node {rep.node}) was not ready after {timeout_s:g} s")

    # ---- what AsyncLLM (lesson 21) and the load generator (lesson 19) call --------------------
    @property
    def error(self) -> EngineDead | None:
        return self._pool.error

    async def stream(self, prompt_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[tuple[TokenEvent, dict | None]]:
        """(token event, its logprobs entry or None) as the replica produces them. Leaving early
        aborts the request on its replica. params: lesson 20's, or lesson 06's (the load generator's)."""
        pend = Pending(list(prompt_ids), params, asyncio.get_running_loop(), asyncio.Queue())
        self._pool.submit(pend)
        done = False
        try:
            while True:
                item = await pend.queue.get()
                if isinstance(item, Reroute):
                    self._pool.submit(pend)
                    continue
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item[0].finished:
                    done = True
                    return
        finally:
            if not done:
                self._pool.abort(pend)

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> AsyncIterator[TokenEvent]:
        events = self.stream(prompt_ids, params or SamplingParams())
        try:
            async for event, _ in events:
                yield event
        finally:
            await events.aclose()

    def drive(self, fn):
        raise RuntimeError("the engines run in the replica processes; call fn directly")

    # ---- what the lesson reads ----------------------------------------------------------------
    def replica_stats(self) -> list[EngineStats | None]:
        """Each replica's last report (the engine's own counters)."""
        return [r.stats for r in self._pool.replicas]

    def stats(self) -> EngineStats:
        """All replicas summed: what lesson 21's /metrics serves."""
        reports = [s for s in self.replica_stats() if s is not None]
        return EngineStats(*(sum(v) for v in zip(*(vars(s).values() for s in reports)))) if reports \
            else EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0)

    def routed(self) -> list[int]:
        """Requests sent to each replica so far (re-routed ones count where they went, too)."""
        return list(self._pool.routed)

    def timelines(self, timeout_s: float = 5.0) -> list[Timeline]:
        """Each live replica's engine steps since the last call (trace=True), as lesson-wide
        Timelines. perf_counter_ns is one clock for all processes of a machine: no offset."""
        asked = [r for r in self._pool.replicas if r.alive]
        for r in asked:
            r.timeline = None
            r.send(("timeline",))
        deadline = time.monotonic() + timeout_s
        while any(r.timeline is None and r.alive for r in asked) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [Timeline.from_dict(r.timeline) for r in asked if r.timeline is not None]

    def alive(self) -> list[bool]:
        return [r.alive for r in self._pool.replicas]

    def pids(self) -> list[int]:
        """Each replica's process id, on its own machine."""
        return [r.pid for r in self._pool.replicas]

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self, wait_s: float = 5.0) -> None:
        """Stop every replica (ask, then terminate, then kill) and end what is in flight. Idempotent."""
        if self._finalizer.detach() is not None:
            self._pool.close(wait_s)

    shutdown = close

    def __enter__(self) -> "DPFrontEnd":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
