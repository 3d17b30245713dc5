"""Lesson 17's tensor-parallel engine with two-batch overlap (SGLang's TBO, vLLM's --enable-dbo).

    rank 0 (the user process)                          ranks 1 .. tp-1
    scheduler, sampler, its shard                      their shards (worker.py)
    step(): schedule; StepHeader + StepMetadata ---control---> receive
            every rank cuts the batch the same way (split.py) and runs the layers in the
            overlap schedule (schedule.py): A's all-reduces in flight while B computes
            logits <========= gather ======== their vocabulary part

Everything but the forward is TPEngine's: the rendezvous (WorkerSet), launch on one or several
machines, faults (WorkerFailed within seconds, nothing left running), close(). Its constructor
is not reused because it starts lesson 17's worker function; this one starts worker.py's.

The collectives go through gloo only: an asynchronous all-reduce needs a communicator with
threads of its own, and lesson 17's shared-memory all-reduce is a blocking call on the
compute thread. `overlap` can be switched between steps (`engine.overlap = False`): the
same processes then run lesson 17's schedule, which is what run.py compares against.
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from minivllm_support.models import check_model_dir
from minivllm_support.timeline import Timeline, measure_offset
from step04_transformer.config import ModelConfig
from step09_continuous_batching.scheduler import ScheduledBatch
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import Engine, create_kv_pool, create_scheduler, fit_block_size
from step16_cuda_graph.cpu.engine import KernelSampler
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import TPEngine, TPRunner, _release, sampled_rows
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world, placement, placement_table
from step17_tensor_parallel.metadata import StepMetadata
from step17_tensor_parallel.model import check_tp_shapes
from step17_tensor_parallel.workers import WorkerFailed, WorkerSet
from advanced.adv09_overlap.recorder import StepRecorder
from advanced.adv09_overlap.schedule import run_layers
from advanced.adv09_overlap.worker import (TIMELINE_REQUEST, OverlapSpec, StepHeader, overlap_worker_main,
                                           pack_step, prepare_shard)


class OverlapRunner(TPRunner):
    """Rank 0's runner: the step message carries the step number and the schedule to use."""

    def __init__(self, model, conns, timeout_s: float, overlap: bool):
        super().__init__(model, conns)
        self.timeout_s, self.overlap = timeout_s, overlap
        self.recorder = StepRecorder(0)
        self.steps = 0

    def forward(self, batch: ScheduledBatch, input_ids, positions, attn):
        rec = self.recorder
        rec.begin_step(self.steps, self.overlap)
        self.steps += 1
        data = pack_step(StepHeader(rec.step, self.overlap),
                         StepMetadata.from_attention(input_ids, positions, attn, sampled_rows(batch)))
        for conn in self.conns:
            conn.send_bytes(data)
        self.metadata_bytes += len(data) * len(self.conns)
        self.metadata_messages += len(self.conns)
        return run_layers(self.model, input_ids, positions, attn, self.overlap, rec, self.timeout_s)

    def compute_logits(self, hidden):
        with self.recorder.timed("lm head + gather"):
            return self.model.compute_logits(hidden)


class OverlapEngine(TPEngine):
    def __init__(self, model: str | Path, scheduler: PagedSchedulerConfig | None = None, *,
                 tensor_parallel_size: int = 2, overlap: bool = True, dtype: torch.dtype = torch.bfloat16,
                 threads_per_rank: int | None = None, timeout_s: float = 60.0, attention_backend: str = "auto",
                 pack_weights: bool = True, launch: NodeLaunch | None = None):
        """As TPEngine (lesson 17), gloo only. overlap: split each step of two or more sequences
        into two micro-batches whose all-reduces hide behind each other's compute (switchable
        between steps through the `overlap` attribute)."""
        folder = check_model_dir(Path(model))
        tp = tensor_parallel_size
        check_tp_shapes(ModelConfig.from_pretrained(folder), tp)       # before any process starts
        if tp < 2:
            raise ValueError(f"two-batch overlap hides all-reduces between ranks: tensor_parallel_size must be "
                             f">= 2, got {tp} (one process: lesson 16's engine)")
        if dist.is_initialized():
            raise RuntimeError("this process already runs a process group (a TP or PP engine): close() it first")
        launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if launch.torchrun:
            check_torchrun_world(tp, f"tensor_parallel_size={tp}")
        if launch.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {launch.node_rank} runs headless workers: "
                             f"python -m advanced.adv09_overlap.node --node-rank {launch.node_rank} ...")
        self.tp, self.timeout_s, self.closed, self.launch = tp, timeout_s, False, launch
        self.all_reduce, self.shm_path = "gloo", None
        self._threads_before = torch.get_num_threads()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // len(launch.local_ranks(tp)))
        torch.set_num_threads(threads)
        self.worker_set = ws = WorkerSet(launch, tp, "tbo", "two-batch overlap")
        self.workers, self.conns, self.ranks = ws.procs, ws.conns, ws.ranks
        self.offsets = [0] * tp

        def spec(rank: int) -> OverlapSpec:
            return OverlapSpec(str(folder), rank, tp, ws.port, dtype, threads, timeout_s, pack_weights,
                               master_addr=launch.master_addr, nnodes=launch.nnodes,
                               rendezvous_timeout_s=launch.rendezvous_timeout_s)
        for rank in ws.local_ranks():
            ws.spawn(rank, overlap_worker_main, spec(rank))
        # Runs at garbage collection or at interpreter exit, unless close() ran first.
        self._finalizer = weakref.finalize(self, _release, self.workers, self.conns, None, self._threads_before)
        try:
            ws.accept(spec(0).flags())
            if launch.multi_node or launch.torchrun:
                print(f"[minivllm] all {tp} ranks joined:\n{placement_table(placement(tp, 1, launch.nnodes))}",
                      flush=True)
            parallel.init_group(ws.store, 0, tp, timeout_s)
            shard, weights = prepare_shard(str(folder), 0, tp, dtype, pack_weights)
            attention = choose_backend(attention_backend, "cpu")
            config = fit_block_size(scheduler or PagedSchedulerConfig(), attention)
            pool = create_kv_pool(shard, config, attention)
            Engine.__init__(self, shard, create_scheduler(config, pool.num_blocks), pool, attention,
                            OverlapRunner(shard, self.conns, timeout_s, overlap), KernelSampler())
            self.rank_memory = [{"weight_bytes": weights, "kv_bytes": pool.nbytes}]
            for conn in self.conns:
                conn.send((pool.num_blocks, pool.block_size, attention.name))
            self.rank_memory += ws.wait_ready()
            self.offsets[1:] = [measure_offset(conn) for conn in self.conns]
        except BaseException as e:
            raise self._fail(e) from e

    @property
    def overlap(self) -> bool:
        return self.runner.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.runner.overlap = bool(value)

    def collect_timelines(self, clear: bool = True) -> list[Timeline]:
        """Every rank's three rows (recorder.py) on rank 0's clock; call it between steps."""
        if self.closed:
            raise RuntimeError("this OverlapEngine is closed: make a new one")
        out = [Timeline.from_dict(d) for d in self.runner.recorder.to_dicts()]
        try:
            for conn, rank in zip(self.conns, self.ranks):
                conn.send_bytes(TIMELINE_REQUEST)
                kind, info = conn.recv() if conn.poll(self.timeout_s) else ("silent", "sent no timeline")
                if kind != "timeline":
                    raise WorkerFailed(f"rank {rank} answered the timeline request with {kind}: {info}")
                for d in info:
                    out.append(Timeline.from_dict(d))
                    out[-1].offset_ns = self.offsets[rank]
        except BaseException as e:
            raise self._fail(e) from e
        if clear:
            self.runner.recorder.clear()
        return out
