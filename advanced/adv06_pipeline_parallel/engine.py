"""Lesson 15's engine (with lesson 16's fast-path model) over `pipeline_parallel_size` processes, with micro-batches in flight.

    rank 0 (the user process)                 rank 1                    ... rank p-1 (last stage)
    m virtual engines: scheduler + blocks     layers of stage 1             its layers, final norm
    stage 0: embedding + its layers, LM head
    step k (virtual engine v = k % m):
      1. complete v's previous micro-batch:  <======= normed hidden of its sampled rows ========|
         LM head on those rows, sample, update its sequences
      2. schedule v, send the step to all --control--> ...
         run stage 0, isend hidden ============> recv, run, isend ===> ... recv, run, isend --^
         return at once: rank 0 goes on to step k+1 while stages 1.. work on micro-batch k

With tensor_parallel_size = T each stage is T ranks splitting its layers (tp_stage.py): rank 0
is stage 0's first; every rank of a stage runs each micro-batch together (their all-reduces).

With m = 1 every step waits for the whole pipeline before the next is scheduled: stage s
idles while the others compute. With m >= p, p micro-batches are in flight and every stage
has work. The micro-batches are vLLM V0's virtual engines (virtual.py).

Start, faults and shutdown are lesson 17's WorkerSet (workers.py there): the stages dial rank
0's control socket, on this machine or on others (`launch`, node.py); a stage that raises
sends its traceback and exits, one that dies closes its sockets; either way rank 0's receive
fails at once (one that hangs: after `timeout_s`) and WorkerFailed carries the workers' own
account. The engine is then closed.
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
from step05_naive.generate import check_prompt
from step06_sampler.params import SamplingParams
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import fit_block_size
from step16_cuda_graph.cpu.engine import KernelSampler
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import _release
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world, placement, placement_table
from step17_tensor_parallel.metadata import StepMetadata
from step17_tensor_parallel.model import local_config
from step17_tensor_parallel.workers import WorkerFailed, WorkerSet
from advanced.adv06_pipeline_parallel import p2p
from advanced.adv06_pipeline_parallel.partition import partition_layers
from advanced.adv06_pipeline_parallel.stage import Stage, stage_config
from advanced.adv06_pipeline_parallel.tp_stage import join_tp_groups
from advanced.adv06_pipeline_parallel.virtual import InFlight, VirtualEngine, step_inputs, virtual_engines
from advanced.adv06_pipeline_parallel.worker import (StageSpec, prepare_stage, run_flags, stage_label,
                                                     stage_worker_main, startup_timeout)


class PPEngine(LLMEngine):
    def __init__(self, model: str | Path, scheduler: PagedSchedulerConfig | None = None, *,
                 pipeline_parallel_size: int = 2, num_micro_batches: int | None = None, tensor_parallel_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, threads_per_rank: int | None = None, timeout_s: float = 60.0,
                 layer_partition=None, attention_backend: str = "auto", fast_path: bool = True,
                 launch: NodeLaunch | None = None):
        """model: a checkpoint folder (each stage reads only its tensors). num_micro_batches:
        micro-batches in flight (default p). kv_cache_bytes of the config is a budget per rank.
        layer_partition: layers per stage, e.g. [14, 16] (default: partition.py's rule).
        tensor_parallel_size: ranks per stage, each layer split over them (tp_stage.py): p x tp ranks.
        launch: where the ranks run (lesson 17's launch.py; default: torchrun's environment if
        any, else this machine); placement(tp, p, nnodes): a stage's TP group on one node."""
        folder = check_model_dir(Path(model))
        cfg, p, tp = ModelConfig.from_pretrained(folder), pipeline_parallel_size, tensor_parallel_size
        local = local_config(cfg, tp)                                       # refuses a model tp cannot split
        bounds = partition_layers(cfg.num_layers, p, layer_partition)      # errors before any process
        self.stages = [Stage(i, p, a, b) for i, (a, b) in enumerate(bounds)]
        config = scheduler or PagedSchedulerConfig()
        if not isinstance(config, PagedSchedulerConfig):
            raise TypeError("PPEngine needs a PagedSchedulerConfig (block_size, kv_cache_bytes)")
        self.attention = choose_backend(attention_backend, "cpu")
        self.config = fit_block_size(config, self.attention)
        widest = max(self.stages, key=lambda s: s.num_layers)          # every pool gets the same blocks
        self.num_blocks = self.config.kv_cache_bytes // self.attention.pool_class.bytes_per_block(
            stage_config(local, widest), self.config.block_size, dtype)
        m = p if num_micro_batches is None else num_micro_batches
        virtual_engines(self.config, self.num_blocks, m)           # a bad m or a tiny pool: refused now
        world = p * tp
        if world > 1 and dist.is_initialized():
            raise RuntimeError("this process already runs a process group (a TP or PP engine): close() it first")
        self.launch = launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if world > 1 and launch.torchrun:
            check_torchrun_world(world, f"pipeline_parallel_size={p} x tensor_parallel_size={tp}")
        if world > 1 and launch.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {launch.node_rank} runs its stages headless: "
                             f"python -m advanced.adv06_pipeline_parallel.node --node-rank {launch.node_rank} ...")
        self.pp, self.tp, self.world, self.timeout_s, self.closed = p, tp, world, timeout_s, False
        self.workers, self.conns, self.rank_memory, self.offsets = [], [], [], [0] * world
        self.timeline = Timeline(0, stage_label(self.stages[0]) + " + scheduler, LM head, sampler")
        self.bytes_sent = {"hidden": 0, "returned": 0, "metadata": 0}
        self.messages_sent = 0
        self._threads_before = torch.get_num_threads()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // (len(launch.local_ranks(world)) if world > 1 else 1))
        torch.set_num_threads(threads)
        layers = ",".join(str(s.num_layers) for s in self.stages)

        def spec(rank: int, port: int = 0) -> StageSpec:
            return StageSpec(str(folder), self.stages[rank // tp], port, dtype, threads, timeout_s, fast_path, layers,
                             launch.master_addr, launch.nnodes, launch.rendezvous_timeout_s, tp, rank % tp)
        try:
            if world > 1:
                self.worker_set = ws = WorkerSet(launch, world, "pp", "pipeline")
                self.workers, self.conns = ws.procs, ws.conns
                for rank in ws.local_ranks():
                    ws.spawn(rank, stage_worker_main, spec(rank, ws.port))
                # Runs at garbage collection or at interpreter exit, unless close() ran first.
                self._finalizer = weakref.finalize(self, _release, self.workers, self.conns, None,
                                                   self._threads_before)
                ws.accept(run_flags(str(folder), dtype, p, launch.nnodes, layers, tp))
                if launch.multi_node or launch.torchrun:
                    print(f"[minivllm] all {world} ranks joined:\n{placement_table(placement(tp, p, launch.nnodes))}",
                          flush=True)
                parallel.init_group(ws.store, 0, world, startup_timeout(timeout_s))
                if tp > 1:
                    join_tp_groups(p, tp, 0, startup_timeout(timeout_s))
            model0, weights = prepare_stage(spec(0))
            self.pool = self.attention.pool_class(stage_config(model0.config, self.stages[0]), self.num_blocks,
                                                  self.config.block_size, dtype)
            self.rank_memory.append({"weight_bytes": weights, "kv_bytes": self.pool.nbytes})
            for conn in self.conns:
                conn.send((self.num_blocks, self.config.block_size, self.attention.name))
            if world > 1:
                self.rank_memory += ws.wait_ready()
                self.offsets[1:] = [measure_offset(conn) for conn in self.conns]
        except BaseException as e:
            raise self._fail(e) from e
        super().__init__(model0, None, sampler=KernelSampler())
        self.set_micro_batches(m)

    @property
    def last_stage_rank(self) -> int:
        """The last stage's first TP rank: it sends the normed rows back to rank 0."""
        return (self.pp - 1) * self.tp

    def make_scheduler(self, config):
        return None           # no engine-wide scheduler: each virtual engine has its own (self.virtual)

    def set_micro_batches(self, m: int) -> None:
        """Split the KV blocks among m virtual engines (only while nothing is running)."""
        if self.has_unfinished():
            raise RuntimeError("set_micro_batches: finish the running requests first")
        self.virtual, self._next = virtual_engines(self.config, self.num_blocks, m), 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None) -> Sequence:
        params = params or SamplingParams()
        cfg = self.model.config
        check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, params.max_tokens)
        seq = Sequence(list(prompt_ids), params)
        min(self.virtual, key=lambda v: v.load).scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return any(v.in_flight or v.scheduler.has_unfinished() for v in getattr(self, "virtual", []))

    # ---- the step: complete this virtual engine's last micro-batch, launch its next ----------
    def step(self) -> list[Sequence]:
        if self.closed:
            raise RuntimeError("this PPEngine is closed (after close() or a worker failure): make a new one")
        try:
            if self.world > 1:
                self.worker_set.check_alive()
            v = self.virtual[self._next % len(self.virtual)]
            self._next += 1
            done = self._complete(v) if v.in_flight else []
            self._launch(v)
            return done
        except BaseException as e:
            raise self._fail(e) from e

    def _launch(self, v: VirtualEngine) -> None:
        tl, k = self.timeline, self.num_steps
        with tl.span("schedule", "schedule", step=k, micro_batch=v.index):
            batch = v.scheduler.schedule()
            if not batch:
                return
            ids, positions, rows, sampled = step_inputs(batch)
            attn = v.attention(self.pool, batch, self.attention)
            decodes = sum(1 for s in batch.seqs if s.num_computed_tokens >= s.num_prompt_tokens)
            if self.conns:
                msg = p2p.pack_step(p2p.StepHeader(k, v.index, decodes),
                                    StepMetadata.from_attention(ids, positions, attn, rows))
                for conn in self.conns:
                    conn.send_bytes(msg)
                self.bytes_sent["metadata"] += len(msg) * len(self.conns)
                self.messages_sent += len(self.conns)
        self.num_steps += 1
        with tl.span(f"mb{v.index}", "compute", step=k, micro_batch=v.index,
                     prefill_tokens=len(ids) - decodes, decode_tokens=decodes):
            hidden = self.model(ids, positions, attn)
            logits = self.model.compute_logits(hidden[rows]) if self.pp == 1 and rows else None
        flight = InFlight(k, batch, sampled, logits)
        if self.pp > 1:
            nbytes = hidden.numel() * hidden.element_size()
            with tl.span("send hidden", "send", step=k, bytes=nbytes):
                hidden = hidden.contiguous()
                flight.sends.append((p2p.isend(hidden, self.tp), hidden))      # stage 1's first rank
                if rows:          # the last stage's normed rows: rank 0 runs the LM head on them
                    flight.rows = torch.empty(len(rows), hidden.shape[1], dtype=hidden.dtype)
                    flight.recv = p2p.irecv(flight.rows, self.last_stage_rank)
            self.bytes_sent["hidden"] += nbytes * (self.pp - 1) * self.tp       # every TP rank sends its copy
            self.bytes_sent["returned"] += 0 if flight.rows is None else flight.rows.numel() * hidden.element_size()
            self.messages_sent += (self.pp - 1) * self.tp + (flight.rows is not None)
        v.in_flight = flight

    def _complete(self, v: VirtualEngine) -> list[Sequence]:
        """Wait for the last stage's rows of v's micro-batch launched m steps ago; LM head; sample."""
        f, tl = v.in_flight, self.timeline
        with tl.span("wait for rows", "recv", step=f.step):
            for work, _ in f.sends:
                p2p.wait(work, f"send of step {f.step} to rank 1", self.timeout_s)
            if f.recv is not None:
                p2p.wait(f.recv, f"hidden rows of step {f.step} from rank {self.last_stage_rank}", self.timeout_s)
        if f.rows is not None:
            with tl.span("lm head", "compute", step=f.step, rows=len(f.rows)):
                f.logits = self.model.compute_logits(f.rows)
        with tl.span("sample", "sample", step=f.step):
            tokens = self.sampler(f.logits, [s.params for s in f.sampled],
                                  [s.generator for s in f.sampled]).tolist() if f.sampled else []
            v.complete(tokens, self.eos_ids)
        return f.sampled

    # ---- the timeline ----------------------------------------------------------------------
    def collect_timelines(self, clear: bool = True) -> list[Timeline]:
        """Every rank's spans on rank 0's clock (call it between runs, with nothing in flight)."""
        if any(v.in_flight for v in self.virtual):
            raise RuntimeError("collect_timelines: micro-batches still in flight; finish the requests first")
        out = [Timeline.from_dict(self.timeline.to_dict())]
        for rank, conn in enumerate(self.conns, start=1):
            conn.send_bytes(p2p.TIMELINE_REQUEST)
            kind, info = conn.recv() if conn.poll(self.timeout_s) else ("silent", "did not send its timeline")
            if kind != "timeline":
                raise self._fail(WorkerFailed(f"pipeline rank {rank} failed:\n{info}"))
            out.append(Timeline.from_dict(info))
            out[-1].offset_ns = self.offsets[rank]
        if clear:
            self.timeline.clear()
        return out

    # ---- faults and shutdown: lesson 17's WorkerSet, naming the stage ----------------------
    def _fail(self, error: BaseException) -> BaseException:
        """Close everything; return the error to raise: the workers' own account if they have one."""
        report = self.worker_set.report() if self.world > 1 and hasattr(self, "worker_set") else ""
        self.close(wait_s=0.1)
        blamed = isinstance(error, (WorkerFailed, parallel.CollectiveError)) or "process ended" in report \
            or "Traceback" in report or "connection lost" in report
        if isinstance(error, KeyboardInterrupt) or not blamed:
            return error
        return WorkerFailed(f"pipeline step failed on rank 0 with: {error}\nworker report:\n{report or '(none)'}")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the stages, leave the process group, restore rank 0's thread count. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for v in getattr(self, "virtual", []):
            v.in_flight = None
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
            _release(self.workers, self.conns, None, self._threads_before, wait_s)
        else:
            torch.set_num_threads(self._threads_before)

    def __enter__(self) -> "PPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
