"""A worker rank: its shard of the model, its slice of the KV pool, and a loop that runs
whatever step rank 0 describes.

    worker: dial the store, then rank 0's control socket (control.py), join the process group
    rank 0 --control--> worker: pool spec (once), then one StepMetadata per step, b"" to stop
    worker --control--> rank 0: ("ready", facts) once, or ("error", traceback) before it exits
    all ranks <-gloo/NCCL-> the all-reduces and the logits gather, inside the forward

The same function runs a worker that rank 0 spawned on its own machine, one that a headless
node spawned (node.py), and one that torchrun started: each finds rank 0 the same way.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.backends import choose_backend
from step17_tensor_parallel import control, parallel
from step17_tensor_parallel.lifeline import die_with_parent
from step17_tensor_parallel.loader import load_tp_model
from step17_tensor_parallel.metadata import MetadataAttention, StepMetadata
from step17_tensor_parallel.shm_allreduce import ShmAllReduce

# Fault injection for the tests and for trying it by hand: "raise@N" makes the last rank raise
# at its N-th step, "hang@N" makes it stop answering (rank 0 then hits the collective timeout).
FAULT_ENV = "MINIVLLM_TP_FAULT"


@dataclass
class WorkerSpec:
    folder: str
    rank: int
    world: int
    port: int
    dtype: torch.dtype
    threads: int
    timeout_s: float
    pack_weights: bool
    shm_path: str | None = None      # the shared-memory all-reduce's file, when used
    shm_elems: int = 0
    master_addr: str = "127.0.0.1"   # where the store and rank 0 are
    nnodes: int = 1
    rendezvous_timeout_s: float = 60.0

    def flags(self) -> control.RunFlags:
        return control.RunFlags(control.model_fingerprint(self.folder), str(self.dtype), self.world, self.nnodes)

    def who(self) -> str:
        return f"rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _fault(spec: WorkerSpec) -> tuple[str, int] | None:
    value = os.environ.get(FAULT_ENV, "")
    if "@" not in value or spec.rank != spec.world - 1:
        return None
    kind, step = value.split("@", 1)
    return kind, int(step)


@dataclass
class WorkerExit:
    """What `worker_exit` must know while a worker runs: its connection to rank 0, once there is one."""
    label: str
    conn: Connection | None = None


@contextmanager
def worker_exit(label: str) -> Iterator[WorkerExit]:
    """How every worker process ends (this lesson's and the advanced lessons' engines): quietly
    when rank 0 is gone or on Ctrl-C; with exit code 2 when the rendezvous failed (nobody to
    tell); otherwise its traceback goes to rank 0 and it exits 1. It always leaves the process
    group. And it never outlives the process that started it (lifeline.py)."""
    die_with_parent()
    state = WorkerExit(label)
    try:
        yield state
    except (EOFError, KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        pass                                             # rank 0 is gone or Ctrl-C: just leave
    except control.RendezvousError as e:
        print(f"[minivllm] {e}", flush=True)            # no rank 0 to tell (or it refused us)
        raise SystemExit(2)
    except BaseException:
        if state.conn is None:
            traceback.print_exc()
            raise SystemExit(1)
        try:
            state.conn.send(("error", f"{label}: {traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
        raise SystemExit(1)
    finally:
        parallel.close_group()


def join_rank0(rank: int, world: int, port: int, master_addr: str, flags: control.RunFlags, who: str,
               rendezvous_timeout_s: float, group_timeout_s: float):
    """A worker's way in: the store (as a client), rank 0's control socket, the process group.
    Returns (store, connection to rank 0)."""
    store = parallel.make_store(rank, world, port, rendezvous_timeout_s, master_addr, is_master=False)
    conn = control.connect_to_rank0(store, master_addr, rank, flags, who, rendezvous_timeout_s)
    parallel.init_group(store, rank, world, group_timeout_s)
    return store, conn


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process (spawned by rank 0, by a headless node, or by torchrun)."""
    with worker_exit(f"rank {spec.rank}") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        _, conn = join_rank0(spec.rank, spec.world, spec.port, spec.master_addr, spec.flags(), spec.who(),
                             spec.rendezvous_timeout_s, spec.timeout_s)
        state.conn = conn
        if spec.shm_path:
            parent = os.getppid()
            parallel.use_shared_memory(ShmAllReduce(spec.shm_path, spec.rank, spec.world, spec.shm_elems,
                                                    spec.timeout_s, lambda: os.getppid() == parent))
            parallel.barrier()                          # all mapped: rank 0 may unlink the file
        model = load_tp_model(spec.folder, spec.rank, spec.world, spec.dtype)
        weight_bytes = model_bytes(model)
        if spec.pack_weights:
            model = pack_linears(model)             # a new model: the packed one is what runs
        num_blocks, block_size, backend_name = conn.recv()
        backend = choose_backend(backend_name)
        pool = backend.pool_class(model.config, num_blocks, block_size, spec.dtype)
        conn.send(("ready", {"weight_bytes": weight_bytes, "kv_bytes": pool.nbytes}))
        fault, steps = _fault(spec), 0
        while True:
            data = conn.recv_bytes()
            if not data:
                break                                   # rank 0 is closing the engine
            steps += 1
            if fault and steps == fault[1]:
                if fault[0] == "hang":
                    time.sleep(3600)
                raise RuntimeError(f"injected fault ({FAULT_ENV}={fault[0]}@{fault[1]})")
            meta = StepMetadata.from_bytes(data)
            hidden = model(meta.input_ids, meta.positions, MetadataAttention(pool, meta, backend))
            if len(meta.logit_rows):
                model.compute_logits(hidden[meta.logit_rows])   # sends this rank's logits to rank 0
