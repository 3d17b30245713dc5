"""An FFN process (ranks 1 .. n_ffn): every layer's MLP and nothing else; no KV cache, no scheduler.

    per step:
        control  <- plan (step, layers, tokens per micro-batch)    "wait" span: idle between steps
        for layer l, for each micro-batch i this rank serves (in rank 0's order):
            gloo <- h [T_i, hidden] from rank 0                    "recv" span: attention is late
                    (2:1: and [T'_i, hidden] from the other attention rank, if it has an i)
            compute  h + mlp(post_attention_layernorm(h))          "compute" span, on all the rows at once
            gloo -> out [T_i, hidden] to rank 0                    "send" span: just starts it
                    (2:1: each attention rank gets its own rows back)

It joins exactly as lesson 17's worker does (`join_rank0`: the store, rank 0's control socket
with its flags, the process group), ends as every worker of the series ends (`worker_exit`:
traceback to rank 0, exit with its launcher), and answers ("ready", facts) once it has loaded
its weights. Messages between two ranks arrive in the order they are sent, so no tags are
needed: rank 0 sends layer by layer, micro-batch by micro-batch, and this loop takes them in
the same order.
"""
from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from minivllm_support.timeline import Timeline, answer_offset
from step16_cuda_graph.cpu.engine import cpu_fast_path
from step17_tensor_parallel import control
from step17_tensor_parallel.worker import join_rank0, model_bytes, worker_exit
from advanced.adv06_pipeline_parallel import p2p
from advanced.adv11_afd.microbatch import StepPlan, ffn_rank
from advanced.adv11_afd.split import FFNSide, load_ffn_side

# Fault injection in lesson 17's style, on the last FFN rank: "raise@N" raises at its N-th
# step, "hang@N" stops answering, "exit@N" vanishes without a word.
FAULT_ENV = "MINIVLLM_AFD_FAULT"
# The process group waits for every process to start, import torch and join, which on a busy
# machine takes longer than a step may; every wait of a step passes timeout_s itself.
STARTUP_TIMEOUT_S = 120.0


@dataclass
class FFNSpec:
    folder: str
    rank: int
    n_ffn: int
    port: int
    dtype: torch.dtype
    threads: int
    timeout_s: float
    fast_path: bool = True
    master_addr: str = "127.0.0.1"
    nnodes: int = 1
    rendezvous_timeout_s: float = 60.0
    n_attention: int = 1

    @property
    def world(self) -> int:
        return self.n_attention + self.n_ffn

    def flags(self) -> control.RunFlags:
        return run_flags(self.folder, self.dtype, self.n_ffn, self.nnodes, self.n_attention)

    def who(self) -> str:
        return f"FFN rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"


def run_flags(folder: str, dtype: torch.dtype, n_ffn: int, nnodes: int, n_attention: int = 1) -> control.RunFlags:
    """Lesson 17's flags plus the split, so a node started for another ratio is refused by name."""
    return control.RunFlags(control.model_fingerprint(folder), str(dtype), n_attention + n_ffn, nnodes,
                            extra=f"afd attention={n_attention} ffn={n_ffn}")


def prepare_ffn(spec: FFNSpec) -> tuple[FFNSide, int]:
    """The FFN side's weights, transformed as the single-process engine's (lesson 16's fast path)."""
    model = load_ffn_side(spec.folder, spec.dtype)
    weights = model_bytes(model)
    return (cpu_fast_path(model) if spec.fast_path else model), weights


def _fault(spec: FFNSpec) -> tuple[str, int] | None:
    value = os.environ.get(FAULT_ENV, "")
    if "@" not in value or spec.rank != spec.n_ffn:
        return None
    kind, step = value.split("@", 1)
    return kind, int(step)


def ffn_worker_main(spec: FFNSpec) -> None:
    """Entry point of an FFN process (spawned by rank 0)."""
    with worker_exit(f"FFN rank {spec.rank}") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        _, conn = join_rank0(spec.rank, spec.world, spec.port, spec.master_addr, spec.flags(), spec.who(),
                             spec.rendezvous_timeout_s, max(spec.timeout_s, STARTUP_TIMEOUT_S))
        state.conn = conn
        model, weights = prepare_ffn(spec)
        conn.send(("ready", {"weight_bytes": weights, "kv_bytes": 0}))
        answer_offset(conn)
        serve(spec, conn, model)


def serve(spec: FFNSpec, conn: Connection, model: FFNSide) -> None:
    hidden, tl = model.config.hidden_size, Timeline(spec.rank, f"FFN side (rank {spec.rank})")
    sends: deque = deque()            # (work, tensor): a tensor must outlive its send
    fault, count = _fault(spec), 0
    for t0, data in p2p.control_messages(conn, tl):    # until rank 0 closes the engine
        plan = StepPlan.from_bytes(data)
        tl.add("wait for rank 0", "wait", t0, time.perf_counter_ns(), step=plan.step)
        count += 1
        if fault and count == fault[1]:
            if fault[0] == "hang":
                time.sleep(3600)
            if fault[0] == "exit":
                os._exit(3)
            raise RuntimeError(f"injected fault ({FAULT_ENV}={fault[0]}@{fault[1]})")
        mine = [i for i in range(plan.num_micro_batches) if ffn_rank(i, spec.n_ffn) == spec.rank]
        for layer in range(plan.num_layers):
            for i in mine:
                senders = plan.senders(i, spec.n_ffn)       # 2:1: micro-batch i of both attention ranks
                tokens = sum(n for _, n in senders)
                args = dict(step=plan.step, layer=layer, micro_batch=i, tokens=tokens)
                hs = [torch.empty(n, hidden, dtype=spec.dtype) for _, n in senders]
                with tl.span("recv h", "recv", bytes=tokens * hidden * hs[0].element_size(), **args):
                    works = [p2p.irecv(h, src) for h, (src, _) in zip(hs, senders)]
                    for work, (src, _) in zip(works, senders):
                        p2p.wait(work, f"hidden of step {plan.step} layer {layer} from rank {src}", spec.timeout_s)
                with tl.span(f"FFN L{layer} mb{i}", "compute", **args):
                    out = model(layer, torch.cat(hs) if len(hs) > 1 else hs[0]).contiguous()
                with tl.span("send out", "send", **args):
                    while sends and sends[0][0].is_completed():
                        sends.popleft()
                    for piece, (dst, _) in zip(out.split([n for _, n in senders]), senders):
                        piece = piece.contiguous()
                        sends.append((p2p.isend(piece, dst), piece))
        while sends:                                    # rank 0 has them all before its next step
            p2p.wait(sends.popleft()[0], "a send to rank 0", spec.timeout_s)
