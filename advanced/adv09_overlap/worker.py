"""A worker rank of the overlap engine: lesson 17's worker, running the overlap schedule.

    rank 0 --control--> worker: pool spec (once), then per step: StepHeader + StepMetadata;
                        TIMELINE_REQUEST: send your recorded spans; b"" to stop
    all ranks <-gloo-> the embedding's all-reduce, the layers' asynchronous all-reduces (in the
                       same order on every rank: each computes the same cut), the logits gather

The way in (join_rank0), the way out (worker_exit: tracebacks to rank 0, nothing outlives its
parent), the sharded loader and the fault injection (MINIVLLM_TP_FAULT) are lesson 17's. What
differs is the model (its row-parallel linears defer their all-reduce: schedule.py) and that the
step message also says whether to overlap, so one engine can switch per step.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from minivllm_support.timeline import answer_offset
from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.backends import choose_backend
from step17_tensor_parallel import control
from step17_tensor_parallel.loader import load_tp_model
from step17_tensor_parallel.metadata import MetadataAttention, StepMetadata
from step17_tensor_parallel.worker import FAULT_ENV, WorkerSpec, _fault, join_rank0, model_bytes, worker_exit
from advanced.adv09_overlap.recorder import StepRecorder
from advanced.adv09_overlap.schedule import defer_reductions, run_layers

TIMELINE_REQUEST = b"timeline"      # rank 0 asks for the spans (a step message is never these bytes)
HEADER = 2                          # int64s before the metadata: step number, overlap (0/1)


@dataclass
class StepHeader:
    step: int
    overlap: bool


def pack_step(head: StepHeader, meta: StepMetadata) -> bytes:
    return torch.tensor([head.step, int(head.overlap)], dtype=torch.long).numpy().tobytes() + meta.to_bytes()


def unpack_step(data: bytes) -> tuple[StepHeader, StepMetadata]:
    step, overlap = torch.frombuffer(bytearray(data[:8 * HEADER]), dtype=torch.long).tolist()
    return StepHeader(step, bool(overlap)), StepMetadata.from_bytes(data[8 * HEADER:])


@dataclass
class OverlapSpec(WorkerSpec):
    def flags(self) -> control.RunFlags:
        """Lesson 17's flags plus the schedule: a lesson 17 worker would not read these steps."""
        return dataclasses.replace(super().flags(), extra="two-batch overlap")


def prepare_shard(folder: str, rank: int, world: int, dtype: torch.dtype, pack_weights: bool = True):
    """(this rank's shard with deferred all-reduces, its weight bytes): lesson 17's loader,
    lesson 14's packing, schedule.py's PartialSum."""
    model = load_tp_model(folder, rank, world, dtype)
    weights = model_bytes(model)
    if pack_weights:
        model = pack_linears(model)
    return defer_reductions(model), weights


def overlap_worker_main(spec: OverlapSpec) -> None:
    """Entry point of a worker process (spawned by rank 0 or by a headless node)."""
    with worker_exit(f"rank {spec.rank} (two-batch overlap)") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        _, conn = join_rank0(spec.rank, spec.world, spec.port, spec.master_addr, spec.flags(), spec.who(),
                             spec.rendezvous_timeout_s, spec.timeout_s)
        state.conn = conn
        model, weights = prepare_shard(spec.folder, spec.rank, spec.world, spec.dtype, spec.pack_weights)
        num_blocks, block_size, backend_name = conn.recv()
        backend = choose_backend(backend_name)
        pool = backend.pool_class(model.config, num_blocks, block_size, spec.dtype)
        conn.send(("ready", {"weight_bytes": weights, "kv_bytes": pool.nbytes}))
        answer_offset(conn)
        serve(spec, conn, model, pool, backend)


def serve(spec: OverlapSpec, conn: Connection, model, pool, backend) -> None:
    rec = StepRecorder(spec.rank)
    fault, steps = _fault(spec), 0
    while True:
        data = conn.recv_bytes()
        if not data:
            break                                   # rank 0 is closing the engine
        if data == TIMELINE_REQUEST:
            conn.send(("timeline", rec.to_dicts()))
            rec.clear()
            continue
        steps += 1
        if fault and steps == fault[1]:
            if fault[0] == "hang":
                time.sleep(3600)                    # stops answering: rank 0's collective times out
            raise RuntimeError(f"injected fault ({FAULT_ENV}={fault[0]}@{fault[1]})")
        head, meta = unpack_step(data)
        rec.begin_step(head.step, head.overlap)
        hidden = run_layers(model, meta.input_ids, meta.positions, MetadataAttention(pool, meta, backend),
                            head.overlap, rec, spec.timeout_s)
        if len(meta.logit_rows):
            with rec.timed("lm head + gather"):
                model.compute_logits(hidden[meta.logit_rows])   # sends this rank's logits to rank 0
