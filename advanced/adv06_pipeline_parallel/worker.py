"""A stage worker (ranks 1 .. p-1): its layers, its KV pool, and a loop over micro-batches.

    per micro-batch, in the order rank 0 launched them:
        control   <- step message (header + metadata)      "wait" span: idle until rank 0 launches
        gloo      <- hidden [T, hidden] from rank s-1       "recv" span: the upstream stage is late
        compute      its layers (+ final norm)              "compute" span: the only useful time
        gloo      -> hidden to rank s+1, or the normed      "send" span: just starts the send
                     sampled rows [N, hidden] to rank 0

It joins exactly as lesson 17's worker does (worker.py there): dial the store, then rank 0's
control socket with its flags (control.py), then the process group; so the same function runs
a stage that rank 0 spawned and one that a headless node spawned on another machine (node.py).
It answers ("ready", facts) once or ("error", traceback) before it exits, and stops on b"" or
when rank 0's end of the connection closes. The difference from a tensor-parallel worker: that
one runs every step in lock-step with all ranks; a stage only waits for its upstream
neighbour, so while it computes micro-batch k, the stage before it is already on k+1.
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
from step15_flash_attention.backends import choose_backend
from step16_cuda_graph.cpu.engine import cpu_fast_path
from step17_tensor_parallel import control
from step17_tensor_parallel.metadata import MetadataAttention
from step14_batched_forward.packed_linear import pack_linears
from step17_tensor_parallel.worker import join_rank0, model_bytes, worker_exit
from advanced.adv06_pipeline_parallel import p2p
from advanced.adv06_pipeline_parallel.stage import Stage, load_stage, stage_config
from advanced.adv06_pipeline_parallel.tp_stage import join_tp_groups, load_tp_stage

# Fault injection, lesson 17's style: "raise@N" makes the last stage raise at its N-th
# micro-batch, "hang@N" makes it stop answering, "exit@N" makes it vanish without a word.
FAULT_ENV = "MINIVLLM_PP_FAULT"
MAX_PENDING_SENDS = 8        # sends still travelling; older ones are waited for
# The process group waits for every process to start, import torch and join, which on a busy
# machine takes longer than a step may. Every wait of a step passes timeout_s itself.
STARTUP_TIMEOUT_S = 120.0


def startup_timeout(timeout_s: float) -> float:
    return max(timeout_s, STARTUP_TIMEOUT_S)


@dataclass
class StageSpec:
    folder: str
    stage: Stage
    port: int
    dtype: torch.dtype
    threads: int
    timeout_s: float
    fast_path: bool
    layers: str = ""                 # every stage's layer count, "15,15": all nodes must agree
    master_addr: str = "127.0.0.1"   # where the store and rank 0 are
    nnodes: int = 1
    rendezvous_timeout_s: float = 60.0
    tp: int = 1                      # ranks per stage (tp_stage.py): TP x PP
    tp_rank: int = 0

    @property
    def rank(self) -> int:
        return self.stage.index * self.tp + self.tp_rank

    @property
    def world(self) -> int:
        return self.stage.num_stages * self.tp

    def peer(self, stage: int) -> int:
        """The rank with this one's TP rank in pipeline stage `stage`: where hidden states go."""
        return stage * self.tp + self.tp_rank

    def flags(self) -> control.RunFlags:
        return run_flags(self.folder, self.dtype, self.stage.num_stages, self.nnodes, self.layers, self.tp)

    def who(self) -> str:
        return f"pipeline rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"


def run_flags(folder: str, dtype: torch.dtype, pp: int, nnodes: int, layers: str, tp: int = 1) -> control.RunFlags:
    """Lesson 17's flags plus the layer split and the TP size, so that two nodes that cut the
    model differently are refused at the rendezvous, naming it, not at the first hidden state."""
    extra = f"pp_layers={layers}" + (f" tp={tp}" if tp > 1 else "")
    return control.RunFlags(control.model_fingerprint(folder), str(dtype), pp * tp, nnodes, extra=extra)


def stage_label(stage: Stage, tp_rank: int | None = None) -> str:
    label = f"stage {stage.index} (layers {stage.start}-{stage.end - 1})"
    return label if tp_rank is None else f"{label} TP rank {tp_rank}"


def prepare_stage(spec: StageSpec):
    """The stage's model as the single-process engine runs it (lesson 16's CPU fast path; with
    TP, lesson 17's: its split linears packed for oneDNN)."""
    if spec.tp > 1:
        model = load_tp_stage(spec.folder, spec.stage, spec.tp_rank, spec.tp, spec.dtype)
        weights = model_bytes(model)
        return (pack_linears(model) if spec.fast_path else model), weights
    model = load_stage(spec.folder, spec.stage, spec.dtype)
    weights = model_bytes(model)
    return (cpu_fast_path(model) if spec.fast_path else model), weights


def _fault(spec: StageSpec) -> tuple[str, int] | None:
    value = os.environ.get(FAULT_ENV, "")
    if "@" not in value or not spec.stage.is_last or spec.tp_rank != spec.tp - 1:
        return None
    kind, step = value.split("@", 1)
    return kind, int(step)


def stage_worker_main(spec: StageSpec) -> None:
    """Entry point of a stage process (spawned by rank 0 or by a headless node)."""
    with worker_exit(f"rank {spec.rank} ({stage_label(spec.stage, spec.tp_rank if spec.tp > 1 else None)})") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        _, conn = join_rank0(spec.rank, spec.world, spec.port, spec.master_addr, spec.flags(), spec.who(),
                             spec.rendezvous_timeout_s, startup_timeout(spec.timeout_s))
        state.conn = conn
        if spec.tp > 1:
            join_tp_groups(spec.stage.num_stages, spec.tp, spec.rank, startup_timeout(spec.timeout_s))
        model, weights = prepare_stage(spec)
        num_blocks, block_size, backend_name = conn.recv()
        backend = choose_backend(backend_name)
        # model.config is this rank's own: its stage's layers are renumbered, its KV heads its TP share
        pool = backend.pool_class(stage_config(model.config, spec.stage), num_blocks, block_size, spec.dtype)
        conn.send(("ready", {"weight_bytes": weights, "kv_bytes": pool.nbytes}))
        answer_offset(conn)
        run_stage(spec, conn, model, pool, backend)


def run_stage(spec: StageSpec, conn: Connection, model, pool, backend) -> None:
    stage, hidden_size = spec.stage, model.config.hidden_size
    tl = Timeline(spec.rank, stage_label(stage, spec.tp_rank if spec.tp > 1 else None))
    sends: deque = deque()            # (work, tensor): a tensor must outlive its send
    fault, count = _fault(spec), 0
    for t0, data in p2p.control_messages(conn, tl):    # until rank 0 closes the engine
        head, meta = p2p.unpack_step(data)
        tl.add("wait for rank 0", "wait", t0, time.perf_counter_ns(), step=head.step)
        count += 1
        if fault and count == fault[1]:
            if fault[0] == "hang":
                time.sleep(3600)
            if fault[0] == "exit":
                os._exit(3)
            raise RuntimeError(f"injected fault ({FAULT_ENV}={fault[0]}@{fault[1]})")
        T, rows = len(meta.input_ids), meta.logit_rows
        buf = None                                      # stage 0 (TP ranks > 0): embeds the tokens itself
        if not stage.is_first:
            buf, src = torch.empty(T, hidden_size, dtype=spec.dtype), spec.peer(stage.index - 1)
            with tl.span("recv hidden", "recv", step=head.step, bytes=buf.numel() * buf.element_size()):
                p2p.wait(p2p.irecv(buf, src), f"receive of step {head.step} from rank {src}", spec.timeout_s)
        with tl.span(f"mb{head.micro_batch}", "compute", step=head.step, micro_batch=head.micro_batch,
                     prefill_tokens=T - head.decode_tokens, decode_tokens=head.decode_tokens):
            out = model(meta.input_ids, meta.positions, MetadataAttention(pool, meta, backend), buf)
            if stage.is_last:                           # rank 0 runs the LM head on these rows
                out = out[rows] if len(rows) and spec.tp_rank == 0 else None
        if out is None:
            continue                                    # nothing to sample, or another TP rank sends it
        dst = 0 if stage.is_last else spec.peer(stage.index + 1)
        with tl.span("send rows" if stage.is_last else "send hidden", "send", step=head.step,
                     bytes=out.numel() * out.element_size()):
            while sends and (sends[0][0].is_completed() or len(sends) >= MAX_PENDING_SENDS):
                p2p.wait(sends.popleft()[0], "an earlier send", spec.timeout_s)
            out = out.contiguous()
            sends.append((p2p.isend(out, dst), out))
