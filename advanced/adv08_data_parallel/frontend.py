"""The data-parallel front end: N replica processes, one router, one collector thread.

    stream(prompt) --router--> replica i --conn--> ("add", rid, ids, params)
         ^                                                  |  replica i's engine steps
         '--- queue <-- collector thread <--conn-- ("event", rid, token, logprobs, stats)
                          |  every 0.2 s: a replica with requests in flight that has said
                          |  nothing for hang_timeout_s is asked for its stack, then killed
                          '  a conn at EOF: the replica is gone -> its requests are re-routed
                             (no token yet) or fail with EngineDead and its own account

Where the replicas run (lesson 17's launch.py, control.py, workers.py): the front end is rank 0
and hosts the rendezvous; replica i is rank i+1 and dials it, on this machine or another.

    node 0: front end (rank 0) + replicas 0..k-1        node r: python -m advanced.adv08_data_parallel.node
            spawned here, they dial 127.0.0.1                   replicas r*k..r*k+k-1 dial node 0
    k = N / nnodes replicas per node (vLLM: --data-parallel-size-local)
    under torchrun: rank 0 is this front end only, rank r > 0 turns into replica r-1 (placement.py)

It has the shape lesson 20's AsyncLLM drives (`stream`, `error`, `shutdown`) and lesson 18's
load generator drives (`generate`, `threaded`), so both sit on top unchanged.

Failures, by lesson 18's rules (faults.py): a failed step on a replica ends that step's
requests with StepFailed (HTTP 500) and the replica goes on; a replica whose engine is dead,
that exits, is killed, or hangs, takes only its own requests down: those with no token yet go
to another replica (the client saw nothing, so nothing is repeated; once only, in case the
request itself is what kills replicas), the others end with EngineDead (503) naming the
replica and what it said. New requests go to the live replicas; with none left, EngineDead.
The collector's side of this (who is in flight where, who hears what) is hub.py.
"""
from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

import torch

from advanced.adv08_data_parallel.placement import ReplicaSet, replicas_spawned_here
from advanced.adv08_data_parallel.hub import Pending, ReplicaHandle, ReplicaHub, Reroute
from advanced.adv08_data_parallel.replica import ReplicaSpec, replica_main
from advanced.adv08_data_parallel.router import CacheAware, Router, create_router
from minivllm_support.models import resolve_model
from minivllm_support.timeline import Timeline, measure_offset
from step14_batched_forward.engine import EngineStats
from step17_tensor_parallel.launch import NodeLaunch, torchrun_rank
from step18_benchmark.faults import EngineDead
from step18_benchmark.frontend import TokenEvent
from step19_real_model.params import SamplingParams


class DPFrontEnd:
    """N engine replicas behind one router; `with DPFrontEnd(...) as front:` or close()."""
    threaded = True                  # the engines run elsewhere: callers just await
    _thread = None                   # (what lesson 20's AsyncLLM.healthy looks at)

    def __init__(self, model: str | Path | None = None, num_replicas: int = 2, policy: str = "cache_aware", *,
                 dtype: torch.dtype = torch.float32, threads_per_replica: int = 1, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_cache_bytes: int = 128 * 2**20,
                 enforce_eager: bool = True, hang_timeout_s: float = 30.0, start_timeout_s: float = 120.0,
                 trace: bool = False, launch: NodeLaunch | None = None, **router_options):
        """policy, router_options: router.create_router's; checked before any process starts.
        launch: lesson 17's NodeLaunch (default: torchrun's environment if torchrun started this
        process, else every replica on this machine); with nnodes > 1, this is node 0 and the other
        nodes run `python -m advanced.adv08_data_parallel.node`. Under torchrun this is rank 0 and
        every other rank is a replica (node.run_torchrun_replica): world size = num_replicas + 1.
        hang_timeout_s: a replica with requests that sends nothing for this long is stopped.
        trace: each replica records its engine steps; `timelines()` collects them."""
        if hang_timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s and start_timeout_s must be > 0, got {hang_timeout_s}, {start_timeout_s}")
        self.set_policy(policy, num_replicas, **router_options)        # checked before any process starts
        self.model_dir = resolve_model(model)
        launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if launch.torchrun and torchrun_rank() not in (None, 0):
            raise ValueError(f"torchrun rank {torchrun_rank()} is a replica, not the front end: call "
                             f"advanced.adv08_data_parallel.node.run_torchrun_replica(...) first thing")
        here = replicas_spawned_here(num_replicas, launch)             # checks N against the launch
        ws = ReplicaSet(launch, num_replicas + 1, name="dp", what="data-parallel replica")
        try:
            spec = ReplicaSpec(0, num_replicas, str(self.model_dir), dtype, threads_per_replica, max_num_seqs,
                               max_num_batched_tokens, kv_cache_bytes, enforce_eager,
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
        self._hub = ReplicaHub(replicas, self.router, hang_timeout_s)
        # Runs at garbage collection or at interpreter exit, unless close() ran first.
        self._finalizer = weakref.finalize(self, self._hub.close)
        try:
            self.facts = [self._start(r, start_timeout_s, trace) for r in replicas]
        except BaseException:
            self.close(wait_s=0.5)
            raise
        for r, f in zip(replicas, self.facts):
            r.pid = f["pid"]
        self.pool_tokens = min(f["num_blocks"] * f["block_size"] for f in self.facts)
        self.set_policy(policy, num_replicas, **router_options)         # now it can size its trees
        self._hub.thread.start()

    def set_policy(self, policy: str, num_replicas: int | None = None, **router_options) -> Router:
        """A fresh router (run.py compares policies on the same replicas). A cache-aware router's
        trees hold as many tokens as one replica's KV pool unless tree_tokens says otherwise."""
        hub = getattr(self, "_hub", None)
        n = num_replicas or len(hub.replicas)
        if hub is not None and any(r.live for r in hub.replicas):
            raise RuntimeError("set_policy: requests are in flight; change the policy between runs")
        if policy == CacheAware.name and hasattr(self, "pool_tokens"):
            router_options.setdefault("tree_tokens", self.pool_tokens)
        self.router = create_router(policy, n, **router_options)
        for i, alive in enumerate(self.alive() if hub is not None else []):
            if not alive:
                self.router.forget(i)
        if hub is not None:
            hub.router = self.router
        return self.router

    def _start(self, rep: ReplicaHandle, timeout_s: float, trace: bool) -> dict:
        """Its ready facts, its clock offset from ours (timeline.measure_offset's NTP-style ping-pong:
        on another machine the clocks differ), then our trace setting, which so reaches replicas we
        did not start (node.py's, torchrun's)."""
        facts = self._wait_ready(rep, timeout_s)
        try:
            rep.offset_ns = measure_offset(rep.conn)
        except (EOFError, OSError):
            raise RuntimeError(f"replica {rep.index} (node {rep.node}) hung up while its clock was read") from None
        rep.send(("trace", trace))
        return facts

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

    # ---- what AsyncLLM (lesson 20) and the load generator (lesson 18) call --------------------
    @property
    def error(self) -> EngineDead | None:
        return self._hub.error

    async def stream(self, prompt_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[tuple[TokenEvent, dict | None]]:
        """(token event, its logprobs entry or None) as the replica produces them. Leaving early
        aborts the request on its replica. params: lesson 19's, or lesson 06's (the load generator's)."""
        pend = Pending(list(prompt_ids), params, asyncio.get_running_loop(), asyncio.Queue())
        self._hub.submit(pend)
        done = False
        try:
            while True:
                item = await pend.queue.get()
                if isinstance(item, Reroute):
                    self._hub.submit(pend)
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
                self._hub.abort(pend)

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
        return [r.stats for r in self._hub.replicas]

    def stats(self) -> EngineStats:
        """All replicas summed: what lesson 20's /metrics serves."""
        reports = [s for s in self.replica_stats() if s is not None]
        return EngineStats(*(sum(v) for v in zip(*(vars(s).values() for s in reports)))) if reports \
            else EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0)

    def routed(self) -> list[int]:
        """Requests sent to each replica so far (re-routed ones count where they went, too)."""
        return list(self._hub.routed)

    def timelines(self, timeout_s: float = 5.0) -> list[Timeline]:
        """Each live replica's engine steps since the last call (trace=True), as lesson-wide
        Timelines on this process's clock: each carries the offset measured when it started (about 0
        on this machine, whose processes share one monotonic clock; anything on another)."""
        asked = [r for r in self._hub.replicas if r.alive]
        for r in asked:
            r.timeline = None
            r.send(("timeline",))
        deadline = time.monotonic() + timeout_s
        while any(r.timeline is None and r.alive for r in asked) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [replace(Timeline.from_dict(r.timeline), offset_ns=r.offset_ns)
                for r in asked if r.timeline is not None]

    def alive(self) -> list[bool]:
        return [r.alive for r in self._hub.replicas]

    def pids(self) -> list[int]:
        """Each replica's process id, on its own machine."""
        return [r.pid for r in self._hub.replicas]

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self, wait_s: float = 5.0) -> None:
        """Stop every replica (ask, then terminate, then kill) and end what is in flight. Idempotent."""
        if self._finalizer.detach() is not None:
            self._hub.close(wait_s)

    shutdown = close

    def __enter__(self) -> "DPFrontEnd":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
