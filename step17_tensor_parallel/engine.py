"""Lesson 16's fast-path engine over `tensor_parallel_size` processes.

    user process = rank 0                              ranks 1 .. tp-1 (spawned by rank 0, by a
    scheduler, block manager, sequences, sampler       headless node, or by torchrun: launch.py)
    its model shard and KV pool slice                  their shard and pool slice
    start:   the rendezvous (workers.py, control.py): every rank dials in, same flags
    step():  schedule
             metadata ---- control socket, one message ---> receive
             forward  <==== all-reduces (gloo/NCCL) ==> forward
             logits   <======= gather of logits ======= logits of their vocabulary part
             sample, update the sequences

Every rank's pool has the same number of blocks, so rank 0's block tables are valid on all of
them. `kv_cache_bytes` is a budget per rank, as vLLM's gpu_memory_utilization is per GPU: a
rank holds 1/tp of the KV heads, so the same budget buys tp times the blocks.

Failures: a worker that raises sends its traceback and exits; one that is killed closes its
connections. Either way rank 0's next collective fails within milliseconds (a worker that hangs:
within `timeout_s`), rank 0 adds the worker's own words, stops the other ranks and raises
WorkerFailed. The engine is then closed; make a new one.
"""
from __future__ import annotations

import os
import warnings
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from minivllm_support.models import check_model_dir
from step04_transformer.config import ModelConfig
from step04_transformer.loader import load_model
from step09_continuous_batching.scheduler import ScheduledBatch, SchedulerConfig
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import Engine, ModelRunner, create_kv_pool, create_scheduler, fit_block_size
from step16_cuda_graph.cpu import engine as fast_path
from step17_tensor_parallel import control, parallel
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world, placement, placement_table
from step17_tensor_parallel.loader import load_tp_model
from step17_tensor_parallel.metadata import StepMetadata
from step17_tensor_parallel.model import check_tp_shapes
from step17_tensor_parallel.shm_allreduce import ShmAllReduce, create_file, shm_supported
from step17_tensor_parallel.worker import WorkerSpec, model_bytes, worker_main
from step17_tensor_parallel.workers import WorkerFailed, WorkerSet, shutdown


# All-reduces of up to this many tokens (every decode step, small prefill chunks) go through
# shared memory; bigger ones through gloo, whose fixed cost is small next to their compute.
SHM_MAX_TOKENS = 256


def _max_batched_tokens(scheduler) -> int:
    config = getattr(scheduler, "config", scheduler) or SchedulerConfig()
    return config.max_num_batched_tokens


def sampled_rows(batch: ScheduledBatch) -> list[int]:
    """Rows of the step whose logits are read: each sequence's last token when it reaches its
    end this step (the rule of lesson 09's step(), which rank 0 applies on its side)."""
    rows, off = [], 0
    for seq, n in zip(batch.seqs, batch.num_tokens):
        off += n
        if seq.num_computed_tokens + n == seq.num_tokens:
            rows.append(off - 1)
    return rows


def _release(procs: list, conns: list[Connection], shm_path: str | None, threads: int,
             wait_s: float = 5.0) -> None:
    """Everything an engine holds outside its own objects: processes, the worker set, a shm file."""
    shutdown(procs, conns, wait_s)
    if shm_path and os.path.exists(shm_path):
        os.unlink(shm_path)
    parallel.close_group()
    torch.set_num_threads(threads)


class TPRunner(ModelRunner):
    """Rank 0's runner: tells the other ranks what this step is, then runs its own shard (their
    all-reduces meet inside the forward, in the parallel layers)."""

    def __init__(self, model, conns: list[Connection]):
        super().__init__(model)
        self.conns = conns
        self.metadata_bytes = self.metadata_messages = 0    # what the control sockets carried

    def forward(self, batch: ScheduledBatch, input_ids, positions, attn):
        data = StepMetadata.from_attention(input_ids, positions, attn, sampled_rows(batch)).to_bytes()
        for conn in self.conns:
            conn.send_bytes(data)
        self.metadata_bytes += len(data) * len(self.conns)
        self.metadata_messages += len(self.conns)
        return self.model(input_ids, positions, attn)


class TPEngine(Engine):
    def __init__(self, model: str | Path, scheduler: PagedSchedulerConfig | None = None, *, tensor_parallel_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, threads_per_rank: int | None = None,
                 timeout_s: float = 60.0, all_reduce: str = "auto", pack_weights: bool = True,
                 output_processor=None, launch: NodeLaunch | None = None, **kwargs):
        """model: a checkpoint folder (each rank loads its own slices of it). scheduler: the
        engine's PagedSchedulerConfig. kwargs: lesson 16's fast-path build_engine options (tp == 1 only:
        use_graph, max_bucket, ...).

        threads_per_rank: torch threads of each rank (default: the cores shared out evenly;
        rank 0's setting is restored by close()). timeout_s: how long a collective may wait
        for a silent rank before it fails. all_reduce: "gloo" (the process group), "shm"
        (shared memory, x86-64 CPUs) or "auto" (shm where it works, else gloo); shared memory
        only when every rank is on this machine and spawned by it. launch: where the ranks run
        (launch.py; default: torchrun's environment if there is one, else this machine).
        """
        folder = check_model_dir(Path(model))
        tp = tensor_parallel_size
        cfg = ModelConfig.from_pretrained(folder)
        check_tp_shapes(cfg, tp)                                    # before any process starts
        if all_reduce not in ("auto", "gloo", "shm"):
            raise ValueError(f"all_reduce must be 'auto', 'gloo' or 'shm', got {all_reduce!r}")
        if all_reduce == "shm" and not shm_supported():
            raise ValueError("all_reduce='shm' needs an x86-64 machine with /dev/shm; use 'gloo'")
        if tp > 1 and dist.is_initialized():
            raise RuntimeError("this process already runs a TPEngine with tensor_parallel_size > 1 (one "
                               "process group per process): close() it first")
        launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if tp > 1 and launch.torchrun:
            check_torchrun_world(tp, f"tensor_parallel_size={tp}")
        if tp > 1 and launch.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {launch.node_rank} runs headless workers: "
                             f"python -m step17_tensor_parallel.node --node-rank {launch.node_rank} ...")
        self.tp, self.timeout_s, self.closed, self.launch = tp, timeout_s, False, launch
        spawns_all = not launch.multi_node and not launch.torchrun
        if all_reduce == "shm" and not spawns_all:
            raise ValueError("all_reduce='shm' needs every rank on this machine, spawned by this process; use 'gloo'")
        self.all_reduce = ("none" if tp == 1 else "gloo" if all_reduce == "gloo" or not shm_supported() or not spawns_all
                           else "shm")
        self.shm_path: str | None = None
        self.workers: list = []
        self.conns: list[Connection] = []
        self._threads_before = torch.get_num_threads()
        ranks_here = len(launch.local_ranks(tp)) if tp > 1 else 1
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks_here)
        torch.set_num_threads(threads)
        if tp == 1:
            full = load_model(folder, dtype)
            self.rank_memory = [{"weight_bytes": model_bytes(full)}]
            one = fast_path.build_engine(full, scheduler, **kwargs)        # adopt its parts
            super().__init__(one.model, one.scheduler, one.kv_pool, one.attention, one.runner, one.sampler,
                             output_processor=output_processor)
            self.rank_memory[0]["kv_bytes"] = self.kv_pool.nbytes
            return
        shm_elems = min(_max_batched_tokens(scheduler), SHM_MAX_TOKENS) * cfg.hidden_size
        if self.all_reduce == "shm":
            try:
                self.shm_path = create_file(tp, shm_elems)
            except OSError as e:
                warnings.warn(f"no room for the shared-memory all-reduce ({e}); using gloo")
                self.all_reduce = "gloo"
        self.worker_set = ws = WorkerSet(launch, tp, "tp")
        self.workers, self.conns, self.ranks = ws.procs, ws.conns, ws.ranks
        for rank in ws.local_ranks():
            ws.spawn(rank, worker_main, WorkerSpec(str(folder), rank, tp, ws.port, dtype, threads, timeout_s,
                                                   pack_weights, self.shm_path, shm_elems, launch.master_addr,
                                                   launch.nnodes, launch.rendezvous_timeout_s))
        # Runs at garbage collection or at interpreter exit, unless close() ran first.
        self._finalizer = weakref.finalize(self, _release, self.workers, self.conns, self.shm_path,
                                           self._threads_before)
        try:
            ws.accept(control.RunFlags(control.model_fingerprint(folder), str(dtype), tp, launch.nnodes))
            if launch.multi_node or launch.torchrun:
                print(f"[minivllm] all {tp} ranks joined:\n{placement_table(placement(tp, 1, launch.nnodes))}",
                      flush=True)
            parallel.init_group(ws.store, 0, tp, timeout_s)
            if self.shm_path:
                workers = self.workers         # not self: the communicator must not keep the engine alive
                parallel.use_shared_memory(ShmAllReduce(self.shm_path, 0, tp, shm_elems, timeout_s,
                                                        lambda: all(p.is_alive() for p in workers)))
                parallel.barrier()             # every rank has mapped the file ...
                self._unlink_shm()             # ... so its name can go now
            shard = load_tp_model(folder, 0, tp, dtype)
            self.rank_memory = [{"weight_bytes": model_bytes(shard)}]
            if pack_weights:
                shard = pack_linears(shard)        # the parallel layers hold plain nn.Linears inside
            # Graph capture stays off: the recorded step would need the collectives as custom ops
            # on every rank (README: what was left out). So: lesson 15's parts, a TPRunner.
            attention = choose_backend(kwargs.get("attention_backend", "auto"), "cpu")
            config = fit_block_size(scheduler or PagedSchedulerConfig(), attention)
            pool = create_kv_pool(shard, config, attention)
            super().__init__(shard, create_scheduler(config, pool.num_blocks), pool, attention,
                             TPRunner(shard, self.conns), fast_path.KernelSampler(), output_processor=output_processor)
            self.rank_memory[0]["kv_bytes"] = self.kv_pool.nbytes
            for conn in self.conns:
                conn.send((self.kv_pool.num_blocks, self.kv_pool.block_size, self.attention.name))
            self.rank_memory += ws.wait_ready()
        except BaseException as e:
            raise self._fail(e) from e

    # ---- the step --------------------------------------------------------------------------
    def step(self):
        if self.closed:
            raise RuntimeError("this TPEngine is closed (after close() or a worker failure): make a new one")
        if self.tp == 1:
            return super().step()
        try:
            self.worker_set.check_alive()
            return super().step()
        except BaseException as e:
            raise self._fail(e) from e

    # ---- faults and shutdown ----------------------------------------------------------------
    def _fail(self, error: BaseException) -> BaseException:
        """Close everything; return the error to raise: the workers' account if they have one."""
        report = self.worker_set.report() if self.tp > 1 else ""
        self.close(wait_s=0.1)            # they are mid-step: no point waiting for a clean stop
        blamed = isinstance(error, (WorkerFailed, parallel.CollectiveError)) or "process ended" in report \
            or "Traceback" in report or "connection lost" in report
        if isinstance(error, KeyboardInterrupt) or not blamed:
            return error                    # rank 0's own error (or Ctrl-C): raise it as it is
        return WorkerFailed(f"tensor-parallel step failed on rank 0 with: {error}\n"
                            f"worker report:\n{report or '(none)'}")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the workers, leave the process group, restore rank 0's thread count. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        _release(self.workers, self.conns, self.shm_path, self._threads_before, wait_s)

    def _unlink_shm(self) -> None:
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)
