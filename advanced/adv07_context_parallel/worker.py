"""A context-parallel worker: a full copy of the model, and a loop that prefills its share of
whatever prompt rank 0 sends.

    worker: dial the store, then rank 0's control socket (lesson 17's control.py), join the group
    rank 0 --control--> worker: ("prefill", job, token_ids, zigzag) per prompt, b"" to stop
                                (or ("hops", sizes, repeats): time bare ring hops)
    worker --control--> rank 0: ("ready", facts) once, the clock pings, then ("done", report)
                                per prompt, or ("error", traceback) before it exits
    ranks <-gloo isend/irecv-> the K/V blocks of the ring, inside the forward

Lesson 17's worker, joined the same way (worker.py there: the store, `connect_to_rank0` with
the run's flags, then the process group), so it starts the same on this machine or another
one. Two differences: CP splits tokens, not weights, so each worker loads the whole
checkpoint; and a job is a whole prompt, not an engine step, because rank 0's engine only
needs the prompt's K/V (which the ring brings it) and the last token's hidden row.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
from dataclasses import dataclass

import torch

from advanced.adv07_context_parallel.memory import PeakMeter, exact_rss
from advanced.adv07_context_parallel.ring import Ring, RingAttention, time_hops
from advanced.adv07_context_parallel.zigzag import make_layout
from minivllm_support.timeline import Timeline, answer_offset
from step04_transformer.loader import load_model
from step16_cuda_graph.cpu.engine import cpu_fast_path
from step17_tensor_parallel import control
from step17_tensor_parallel.worker import join_rank0, model_bytes, worker_exit

# Fault injection, lesson 17's style: "raise@N", "hang@N" or "exit@N" makes the last rank fail
# in the ring of layer 1 of its N-th prompt, so rank 0 is mid-ring, waiting for a hop.
FAULT_ENV = "MINIVLLM_CP_FAULT"


def start_timeout(timeout_s: float, rendezvous_s: float) -> float:
    """The process group's own timeout, which bounds its rendezvous: every rank starts (spawn,
    imports: seconds on a busy machine), so it gets at least the launch's rendezvous time. A
    ring hop is bounded by `timeout_s` itself (`Ring`), not by this."""
    return max(timeout_s, rendezvous_s)


def run_flags(folder, dtype: torch.dtype, world: int, nnodes: int) -> control.RunFlags:
    """What rank 0 and every worker must agree on (lesson 17's flag check at the rendezvous)."""
    return control.RunFlags(control.model_fingerprint(folder), str(dtype), world, nnodes, extra="context-parallel")


@dataclass
class CPWorkerSpec:
    folder: str
    rank: int
    world: int
    port: int
    dtype: torch.dtype
    threads: int
    timeout_s: float
    exact_memory: bool = False        # memory.exact_rss(): peak figures a benchmark can trust
    master_addr: str = "127.0.0.1"    # where the store and rank 0 are (lesson 17's NodeLaunch)
    nnodes: int = 1
    rendezvous_timeout_s: float = 60.0

    def flags(self) -> control.RunFlags:
        return run_flags(self.folder, self.dtype, self.world, self.nnodes)

    def who(self) -> str:
        return f"rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"


def _fault(spec: CPWorkerSpec) -> tuple[str, int] | None:
    value = os.environ.get(FAULT_ENV, "")
    if "@" not in value or spec.rank != spec.world - 1:
        return None
    kind, job = value.split("@", 1)
    if kind not in ("raise", "hang", "exit"):
        raise ValueError(f"{FAULT_ENV}={value!r}: expected raise@N, hang@N or exit@N")
    return kind, int(job)


def _inject(kind: str) -> None:
    if kind == "hang":
        time.sleep(3600)
    if kind == "exit":
        os._exit(3)                       # dies without a word, as a crash would
    raise RuntimeError(f"injected fault ({FAULT_ENV}={kind})")


def prefill_share(model, token_ids: list[int], rank: int, world: int, zigzag: bool,
                  ring: Ring | None, tl: Timeline, kv_sink=None, hook=None) -> tuple[torch.Tensor, RingAttention]:
    """This rank's part of one prompt's prefill: final hidden states of its own tokens."""
    layout = make_layout(len(token_ids), world, zigzag)
    pos = layout.positions(rank)
    attn = RingAttention(layout, rank, ring, tl, kv_sink)
    attn.hook = hook
    ids = torch.tensor([token_ids[p] for p in pos])
    start = time.perf_counter_ns()
    attn.last_end = start
    hidden = model(ids, torch.tensor(pos), attn)
    attn.mark_linears(len(model.model.layers))          # the last layer's MLP and the final norm
    tl.add("prefill", "other", start, time.perf_counter_ns(), tokens=len(pos), prompt=len(token_ids))
    return hidden, attn


def worker_main(spec: CPWorkerSpec) -> None:
    """Entry point of a worker process (spawned by rank 0, or by a headless node: lesson 17's
    `node.run_node(specs, worker_main, "cp")`)."""
    with worker_exit(f"rank {spec.rank}") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        if spec.exact_memory:
            exact_rss()
        _, conn = join_rank0(spec.rank, spec.world, spec.port, spec.master_addr, spec.flags(), spec.who(),
                             spec.rendezvous_timeout_s, start_timeout(spec.timeout_s, spec.rendezvous_timeout_s))
        state.conn = conn
        model = load_model(spec.folder, spec.dtype)
        weight_bytes = model_bytes(model)
        model = cpu_fast_path(model)                  # rank 0's engine runs the same transforms
        fault, jobs = _fault(spec), 0
        ring = Ring(spec.rank, spec.world, spec.timeout_s)
        conn.send(("ready", {"weight_bytes": weight_bytes}))
        answer_offset(conn)                           # align this clock with rank 0's
        while True:
            raw = conn.recv_bytes()
            if not raw:
                break                                 # rank 0 is closing the engine (lesson 17's b"")
            data = pickle.loads(raw)
            if data[0] == "hops":                    # the link benchmark (engine.measure_hops)
                conn.send(("done", time_hops(ring, data[1], data[2])))
                continue
            _, job, token_ids, zigzag = data
            jobs += 1
            tl = Timeline(spec.rank, f"rank {spec.rank}")
            hook = None
            if fault and jobs == fault[1]:
                hook = lambda layer, kind=fault[0]: _inject(kind) if layer == 1 else None  # noqa: E731
            with PeakMeter() as mem:
                hidden, attn = prefill_share(model, token_ids, spec.rank, spec.world, zigzag, ring, tl, hook=hook)
            # A numpy copy, not a tensor: Connection.send pickles tensors by handing over a shared-memory
            # file descriptor (torch.multiprocessing), which a process started elsewhere cannot open.
            last = hidden[-1].float().numpy() if attn.layout.rank_of_last_token() == spec.rank else None
            conn.send(("done", {"job": job, "timeline": tl.to_dict(), "stats": attn.stats, "peak_bytes": mem.extra,
                                "last_hidden": last}))

