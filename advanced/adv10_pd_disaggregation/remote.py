"""The engines across two machines: lesson 17's rendezvous and control socket in place of pipes.

    node 0                                                node 1
    launcher (PDCluster with launch=...)                  python -m advanced.adv10_pd_disaggregation.node
      hosts the store at --master-addr:--master-port        --role decode (or prefill)
      and the control port (WorkerSet, control.py)          spawns its engine process:
      spawns the other engine process (same path) ---.      dial the store, then the control port,
                                                     |      hello with its RunFlags (model, dtype,
      admits control rank 1 (prefill), 2 (decode) <--'----- world, nnodes, which role node 1 runs)
      sends each its EngineSpec, waits for "ready",       load, join the gloo group (prefill rank 0,
      aligns clocks, then the messages of process.py      decode rank 1) on the same store, serve
                                                          KV: gloo send/recv, machine to machine

Every engine, the one on node 0 too, goes through the same door: the store, the control socket,
the flag check. A node started for another configuration (another role, dtype, model) is
refused at the hello, by the field that differs, and exits with code 2. Only the gloo transport
crosses machines: the store's folder is in /dev/shm, which another machine cannot see.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass

import torch

from minivllm_support.timeline import measure_offset
from step17_tensor_parallel import control, parallel
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.worker import worker_exit
from step17_tensor_parallel.workers import WorkerSet
from advanced.adv10_pd_disaggregation.process import EngineSpec, serve

ROLES = ("prefill", "decode")
CONTROL_RANK = {"prefill": 1, "decode": 2}      # rank 0: the launcher
WORLD = 3                                       # the launcher and the two engines


def pd_flags(folder: str, dtype: torch.dtype, remote: str, nnodes: int, engines: int = 2) -> control.RunFlags:
    """What the launcher and every engine must agree on (lesson 17's RunFlags, compared by field)."""
    return control.RunFlags(control.model_fingerprint(folder), str(dtype), 1 + engines, nnodes,
                            f"transport=gloo, node 1 runs the {remote} engine")


def check_launch(launch: NodeLaunch, mode: str, transport: str, remote: str) -> None:
    """The combinations that can run across machines, or an error naming the one that cannot."""
    if transport != "gloo":
        raise ValueError(f"the {transport!r} transport keeps the KV in files under /dev/shm, which another "
                         f"machine cannot read: across machines use transport 'gloo' (--transports gloo)")
    if mode != "disaggregated" or launch.nnodes != 2 or launch.node_rank != 0 or launch.torchrun:
        raise ValueError(f"across machines: a disaggregated run on 2 nodes, the launcher on node 0 "
                         f"(got mode {mode!r}, --nnodes {launch.nnodes}, --node-rank {launch.node_rank}"
                         f"{', torchrun' if launch.torchrun else ''})")
    if remote not in ROLES:
        raise ValueError(f"the engine on node 1 must be one of {ROLES}, got {remote!r}")


class PDWorkerSet(WorkerSet):
    """Lesson 17's WorkerSet with this lesson's placement: one engine per node."""

    def __init__(self, launch: NodeLaunch, remote: str):
        super().__init__(launch, WORLD, "pd", "PD engine")
        self.remote_rank = CONTROL_RANK[remote]

    def node_of(self, rank: int) -> int:
        return 1 if rank == self.remote_rank else 0


@dataclass
class NodeEngineSpec:
    """An engine that joins the launcher through the store and the control socket."""
    role: str
    folder: str                # this machine's copy of the model
    dtype: torch.dtype
    threads: int
    remote: str                # which role the run puts on node 1 (checked at the hello)
    master_addr: str
    master_port: int
    nnodes: int = 2
    rendezvous_timeout_s: float = 60.0

    @property
    def rank(self) -> int:     # lesson 17's run_node names the process by it
        return CONTROL_RANK[self.role]

    def who(self) -> str:
        return f"{self.role} engine on {socket.gethostname()} pid {os.getpid()}"


def node_engine_main(spec: NodeEngineSpec) -> None:
    """Join the launcher (the store, then the control socket, refused if the flags differ),
    take the EngineSpec it sends, and serve as process.py's engines do."""
    with worker_exit(f"{spec.role} engine") as state:
        store = parallel.make_store(spec.rank, WORLD, spec.master_port, spec.rendezvous_timeout_s,
                                    spec.master_addr, is_master=False)
        flags = pd_flags(spec.folder, spec.dtype, spec.remote, spec.nnodes)
        state.conn = conn = control.connect_to_rank0(store, spec.master_addr, spec.rank, flags, spec.who(),
                                                     spec.rendezvous_timeout_s)
        if not conn.poll(spec.rendezvous_timeout_s):
            raise control.RendezvousError(f"the launcher sent the {spec.role} engine no work within "
                                          f"{spec.rendezvous_timeout_s:g} s")
        work: EngineSpec = conn.recv()
        if work.role != spec.role:
            raise control.RendezvousError(f"the launcher sent a {work.role} engine's work to the {spec.role} engine")
        serve(dataclasses.replace(work, folder=spec.folder, threads=spec.threads), conn, store)


@dataclass
class Admitted:
    """The engines as the launcher holds them after the rendezvous, in control-rank order."""
    names: list[str]
    conns: list
    proc_of: dict                  # role -> process, for the engine on this machine only
    info: list[dict]
    offset_s: dict[str, float]     # role -> seconds to add to its clock to read the launcher's


def admit_engines(ws: PDWorkerSet, specs: list[EngineSpec], launch: NodeLaunch, remote: str,
                  threads: int, timeout_s: float) -> Admitted:
    """Spawn node 0's engine, admit both (the flag check), send each its work, wait for ready,
    align clocks (measure_offset: the other machine's perf_counter starts elsewhere)."""
    folder, dtype = specs[0].folder, specs[0].dtype
    proc_of = {}
    for spec in specs:
        if spec.role != remote:
            ws.spawn(CONTROL_RANK[spec.role], node_engine_main,
                     NodeEngineSpec(spec.role, folder, dtype, threads, remote, launch.master_addr, ws.port,
                                    launch.nnodes, launch.rendezvous_timeout_s))
            proc_of[spec.role] = ws.procs[-1]
    ws.accept(pd_flags(folder, dtype, remote, launch.nnodes))
    by_rank = {CONTROL_RANK[s.role]: dataclasses.replace(s, align_clock=True) for s in specs}
    for rank, conn in zip(ws.ranks, ws.conns):
        conn.send(by_rank[rank])
    names = [by_rank[r].role for r in ws.ranks]
    info = ws.wait_ready(timeout_s)
    offsets = {name: measure_offset(conn) / 1e9 for name, conn in zip(names, ws.conns)}
    return Admitted(names, list(ws.conns), proc_of, info, offsets)
