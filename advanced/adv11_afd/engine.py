"""Lesson 15's engine (with lesson 16's fast-path model) with every layer's MLP in other processes.

    rank 0 (the user process): the attention side          ranks 1 .. n_ffn: the FFN side
    scheduler, block manager, KV pool, sampler             every layer's post-attention norm + MLP
    embedding, every layer's attention half, final norm,   no KV cache, no scheduler, no vocabulary
    LM head
    step():  schedule
             plan (tokens per micro-batch) --control--> each FFN rank
             per layer, per micro-batch:  h ==gloo isend==> FFN ==gloo isend==> out   (runner.py)
             final norm, LM head, sample, update the sequences

The engine is lesson 15's `Engine`, unchanged; only its runner differs (`AFDRunner`), as lesson
17's `TPEngine` differs from it only by its runner. Start, faults and shutdown are lesson 17's
`WorkerSet`: the FFN ranks dial rank 0's control socket with their flags, join the process
group and say "ready"; one that raises sends its traceback and exits, one that is killed closes
its sockets, so rank 0's next receive fails at once (one that hangs: after `timeout_s`) and
`WorkerFailed` carries the workers' own account. The engine is then closed.

2 attention : 1 FFN (`num_attention=2`): rank 2 is a second attention process (peer.py) with its
own KV pool; each sequence lives on rank seq_id % 2, rank 0's one scheduler and sampler serve
both, and the scheduler's prefix cache is kept per rank (owned_cache.py).
"""
from __future__ import annotations

import os
import weakref
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from minivllm_support.models import check_model_dir
from minivllm_support.timeline import Timeline, measure_offset
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import Engine, create_kv_pool, create_scheduler, fit_block_size
from step16_cuda_graph.cpu.engine import KernelSampler, cpu_fast_path
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import _release
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.worker import model_bytes
from step17_tensor_parallel.workers import WorkerFailed, WorkerSet
from advanced.adv06_pipeline_parallel import p2p
from advanced.adv11_afd.ffn_worker import STARTUP_TIMEOUT_S, FFNSpec, ffn_worker_main, run_flags
from advanced.adv11_afd.owned_cache import OwnedPrefixBlockManager
from advanced.adv11_afd.peer import PeerSpec, peer_main
from advanced.adv11_afd.runner import AFDRunner
from advanced.adv11_afd.split import load_attention_side


class AFDEngine(Engine):
    def __init__(self, model: str | Path, scheduler: PagedSchedulerConfig | None = None, *, num_ffn: int = 1,
                 num_micro_batches: int = 2, dtype: torch.dtype = torch.bfloat16, threads_per_rank: int | None = None,
                 timeout_s: float = 60.0, attention_backend: str = "auto", fast_path: bool = True,
                 launch: NodeLaunch | None = None, num_attention: int = 1):
        """model: a checkpoint folder (each side reads only its tensors). num_ffn: FFN processes;
        micro-batch i goes to FFN rank 1 + i % num_ffn. num_micro_batches: how many pieces each
        step's sequences are cut into (fewer when a step has fewer sequences). timeout_s: how long
        a receive waits for a silent FFN rank. launch: lesson 17's NodeLaunch (default: this machine).
        num_attention: attention workers; 2 (2:1) adds a peer process (peer.py) that holds the KV of
        every other sequence, with one FFN rank gathering both."""
        folder = check_model_dir(Path(model))
        if num_ffn < 1:
            raise ValueError(f"num_ffn must be >= 1, got {num_ffn}")
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        if num_attention < 1 or (num_attention > 1 and num_ffn != 1):
            raise ValueError(f"num_attention must be 1, or 2 and more with one FFN rank (N:1); "
                             f"got {num_attention} attention and {num_ffn} FFN")
        config = scheduler or PagedSchedulerConfig()
        if not isinstance(config, PagedSchedulerConfig):
            raise TypeError("AFDEngine needs a PagedSchedulerConfig (block_size, kv_cache_bytes)")
        if dist.is_initialized():
            raise RuntimeError("this process already runs a process group (a TP, PP or AFD engine): close() it first")
        self.launch = launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if launch.torchrun or launch.node_rank != 0:
            raise ValueError("AFDEngine runs on node 0 and spawns or admits its FFN ranks itself (torchrun: not built)")
        if num_attention > 1 and launch.nnodes > 1:
            raise ValueError(f"{num_attention}:{num_ffn} runs on one machine only (other nodes: not built for "
                             f"more than one attention rank)")
        self.world, self.n_ffn, self.timeout_s, self.closed = num_attention + num_ffn, num_ffn, timeout_s, False
        self.n_attention = num_attention
        self.timeline = Timeline(0, "attention side (rank 0)")
        self._threads_before = torch.get_num_threads()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // len(launch.local_ranks(self.world)))
        torch.set_num_threads(threads)
        self.worker_set = ws = WorkerSet(launch, self.world, "afd", "FFN" if num_attention == 1 else "AFD")
        self.workers, self.conns = ws.procs, ws.conns
        attention = choose_backend(attention_backend, "cpu")
        self.config = config = fit_block_size(config, attention)
        for rank in ws.local_ranks():
            if rank <= num_ffn:
                ws.spawn(rank, ffn_worker_main, FFNSpec(str(folder), rank, num_ffn, ws.port, dtype, threads, timeout_s,
                                                        fast_path, launch.master_addr, launch.nnodes,
                                                        launch.rendezvous_timeout_s, num_attention))
            else:
                ws.spawn(rank, peer_main, PeerSpec(str(folder), rank, num_attention, num_ffn, ws.port, dtype, threads,
                                                   timeout_s, config, attention_backend, fast_path,
                                                   launch.master_addr, launch.rendezvous_timeout_s))
        # Runs at garbage collection or at interpreter exit, unless close() ran first.
        self._finalizer = weakref.finalize(self, _release, self.workers, self.conns, None, self._threads_before)
        try:
            ws.accept(run_flags(str(folder), dtype, num_ffn, launch.nnodes, num_attention))
            parallel.init_group(ws.store, 0, self.world, max(timeout_s, STARTUP_TIMEOUT_S))
            model0 = load_attention_side(folder, dtype)
            self.rank_memory = [{"weight_bytes": model_bytes(model0)}]
            model0 = cpu_fast_path(model0) if fast_path else model0
            pool = create_kv_pool(model0, config, attention)
            self.rank_memory[0]["kv_bytes"] = pool.nbytes
            self.rank_memory += ws.wait_ready()
            self.offsets = [0] + [measure_offset(conn) for conn in self.conns]
        except BaseException as e:
            raise self._fail(e) from e
        runner = AFDRunner(model0, pool, attention, self.conns, num_ffn, timeout_s, self.timeline, num_micro_batches,
                           num_attention)
        # N:1: one block manager names blocks in every attention rank's pool, so a prefix cached by
        # one rank's sequence can serve only that rank's: one prefix cache per rank (owned_cache.py).
        parts = {} if num_attention == 1 else {"block_manager_class": partial(OwnedPrefixBlockManager, n_attention=num_attention)}
        super().__init__(model0, create_scheduler(config, pool.num_blocks, **parts), pool, attention, runner,
                         KernelSampler())

    @property
    def traffic(self):
        return self.runner.traffic

    def set_micro_batches(self, m: int) -> None:
        if m < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {m}")
        self.runner.m = m

    def make_attention(self, batch):
        return None              # each micro-batch gets its own step attention (runner.py)

    def compute_logits(self, hidden):
        with self.timeline.span("lm head", "compute", step=self.runner.steps - 1, rows=len(hidden)):
            return super().compute_logits(hidden)

    def step(self):
        if self.closed:
            raise RuntimeError("this AFDEngine is closed (after close() or an FFN failure): make a new one")
        try:
            self.worker_set.check_alive()
            return super().step()
        except BaseException as e:
            raise self._fail(e) from e

    # ---- the timeline ----------------------------------------------------------------------
    def collect_timelines(self, clear: bool = True) -> list[Timeline]:
        """Every rank's spans on rank 0's clock (call it between steps)."""
        out = [Timeline.from_dict(self.timeline.to_dict())]
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(p2p.TIMELINE_REQUEST)
                kind, info = conn.recv() if conn.poll(self.timeout_s) else ("silent", "did not send its timeline")
            except (EOFError, OSError) as e:
                kind, info = "lost", str(e)
            if kind != "timeline":
                raise self._fail(WorkerFailed(f"rank {rank} failed:\n{info}"))
            out.append(Timeline.from_dict(info))
            out[-1].offset_ns = self.offsets[rank]
        if clear:
            self.timeline.clear()
        return out

    # ---- faults and shutdown: lesson 17's WorkerSet -------------------------------------------
    def _fail(self, error: BaseException) -> BaseException:
        """Close everything; return the error to raise: the workers' own account if they have one."""
        report = self.worker_set.report()
        self.close(wait_s=0.1)            # they are mid-step: no point waiting for a clean stop
        blamed = isinstance(error, (WorkerFailed, parallel.CollectiveError)) or "process ended" in report \
            or "Traceback" in report or "connection lost" in report
        if isinstance(error, KeyboardInterrupt) or not blamed:
            return error
        return WorkerFailed(f"AFD step failed on rank 0 (attention side) with: {error}\n"
                            f"workers' report:\n{report or '(none)'}")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the FFN ranks, leave the process group, restore rank 0's thread count. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        _release(self.workers, self.conns, None, self._threads_before, wait_s)
