"""Lesson 16's fast-path engine, whose long prompts are prefilled by `context_parallel_size` processes.

    user process = rank 0                                ranks 1 .. cp-1 (spawned by rank 0,
    engine: scheduler, block manager, paged KV pool      by node.py on another machine, or
                                                         started by torchrun: node.py)
                                                         a full copy of the model each
    add_request(long prompt):
      allocate the prompt's blocks
      job ------------ control socket, one message ----> receive
      forward of its own tokens  <== ring of K/V ==>     forward of their own tokens
        (every K/V block passing by -> its paged pool)
      last token's hidden row (rank 0 holds it) -> logits -> first token
      the sequence joins the running queue               wait for the next prompt
    step(): lesson 16's fast-path decode, in rank 0 alone

CP splits the prompt's tokens, not the weights: norms, projections and MLP run on each rank's
own tokens, and only attention needs the others' keys, which the ring brings (ring.py). After
the prefill the whole KV cache is in rank 0's pool, written by the ring itself, and decoding is
the single-process engine's: the tokens are those of a single-process run.

A prompt shorter than `min_cp_tokens` (or arriving when no seat or no blocks are free) goes
the ordinary way: the scheduler's prefill in rank 0.

The workers start, report and stop through lesson 17's WorkerSet (workers.py there): they dial
rank 0 over its control socket with the run's flags, on this machine or others (`launch`).
Failures follow its contract: a worker that raises sends its traceback and exits, one that is
killed closes its connections: rank 0's next ring hop fails within milliseconds, a worker that
hangs within `timeout_s`. Rank 0 adds the workers' own words (WorkerSet.report), stops them and
raises WorkerFailed; the engine is then closed.
"""
from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from advanced.adv07_context_parallel.memory import PeakMeter, exact_rss
from advanced.adv07_context_parallel.node import check_launch
from advanced.adv07_context_parallel.ring import Ring, time_hops
from advanced.adv07_context_parallel.worker import CPWorkerSpec, prefill_share, run_flags, start_timeout, worker_main
from advanced.adv07_context_parallel.zigzag import make_layout
from minivllm_support.models import check_model_dir
from minivllm_support.timeline import Timeline, measure_offset
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence, SequenceStatus
from step12_paged_attention.kv_pool import slot_mapping
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.engine import Engine
from step16_cuda_graph.cpu import engine as fast_path
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import _release
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.workers import WorkerFailed, WorkerSet
from step17_tensor_parallel.worker import model_bytes


class CPEngine(Engine):
    def __init__(self, model: str | Path, scheduler: PagedSchedulerConfig | None = None, *,
                 context_parallel_size: int = 2, dtype: torch.dtype = torch.bfloat16,
                 threads_per_rank: int | None = None, timeout_s: float = 60.0, zigzag: bool = True,
                 min_cp_tokens: int = 256, exact_memory: bool = False,
                 launch: NodeLaunch | None = None):
        """model: a checkpoint folder (every rank loads all of it). threads_per_rank: torch
        threads of each rank (default: the cores shared out; close() restores rank 0's).
        timeout_s: how long a ring hop may wait for a silent rank. zigzag=False: contiguous
        pieces (the unbalanced split, kept to measure it). exact_memory: every rank's large
        allocations go back to the kernel when freed (memory.py), so each prefill's peak memory
        is its own, for benchmarks (it changes the C allocator of this process too). Every rank
        applies lesson 16's fast-path model transforms, so all run the same numerics. launch: where the
        ranks run (lesson 17's launch.py; default: torchrun's environment if any, else this
        machine). Under torchrun this engine is rank 0 and spawns nobody: every other rank has
        called node.run_torchrun_rank() and dials in; torchrun's world must be cp."""
        folder = check_model_dir(Path(model))
        cp = context_parallel_size
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ValueError(f"context_parallel_size must be an int >= 1, got {cp!r}")
        if cp > 1 and dist.is_initialized():
            raise RuntimeError("this process already runs a process group (another CP or TP engine): close() it first")
        launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if cp > 1:                  # cp == 1 is one process: no rank, no group, torchrun or not
            check_launch(cp, launch)
        self.cp, self.zigzag, self.min_cp_tokens, self.timeout_s = cp, zigzag, max(min_cp_tokens, 2 * cp), timeout_s
        self.closed, self.workers, self.conns, self.jobs = False, [], [], 0
        self.last_prefill: dict | None = None          # what the last CP prefill measured
        self._threads_before = torch.get_num_threads()
        if exact_memory:
            exact_rss()
        ranks_here = len(launch.local_ranks(cp)) if cp > 1 else 1     # also checks cp against --nnodes
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks_here)
        torch.set_num_threads(threads)
        full = load_model(folder, dtype)
        self.weight_bytes = model_bytes(full)
        one = fast_path.build_engine(full, scheduler, use_graph=False)   # lesson 16's fast-path model transforms
        super().__init__(one.model, one.scheduler, one.kv_pool, one.attention, one.runner, one.sampler)
        if exact_memory:       # the pool resident now: a prefill's peak is then activations only
            for t in self.kv_pool.k + self.kv_pool.v:
                t.zero_()
        self._finalizer, self.offsets, self.worker_set = None, [], None
        if cp == 1:
            return
        self.worker_set = ws = WorkerSet(launch, cp, "cp", "context-parallel")
        self.workers, self.conns = ws.procs, ws.conns
        for rank in ws.local_ranks():
            ws.spawn(rank, worker_main, CPWorkerSpec(str(folder), rank, cp, ws.port, dtype, threads, timeout_s,
                                                     exact_memory, launch.master_addr, launch.nnodes,
                                                     launch.rendezvous_timeout_s))
        # Runs at garbage collection or at interpreter exit, unless close() ran first.
        self._finalizer = weakref.finalize(self, _release, self.workers, self.conns, None, self._threads_before)
        try:
            ws.accept(run_flags(folder, dtype, cp, launch.nnodes))       # same model, dtype, sizes everywhere
            parallel.init_group(ws.store, 0, cp, start_timeout(timeout_s, launch.rendezvous_timeout_s))
            self.ring = Ring(0, cp, timeout_s)
            ws.wait_ready()                                   # loading the weights takes a while
            self.offsets = [measure_offset(conn) for conn in self.conns]
        except BaseException as e:
            raise self._fail(e) from e

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None) -> Sequence:
        """Queue a request; a long prompt is prefilled over the cp ranks right away."""
        seq = self._queue(prompt_ids, params)
        bm, sched = self.scheduler.block_manager, self.scheduler
        if (self.cp > 1 and seq.num_prompt_tokens >= self.min_cp_tokens
                and len(sched.running) < sched.config.max_num_seqs
                and bm.blocks_for(seq.num_prompt_tokens) <= bm.num_free_blocks):
            self._prefill_now(seq)
        return seq

    def prefill_prompt(self, prompt_ids, params: SamplingParams | None = None) -> Sequence:
        """The ring prefill whatever the prompt's length (cp == 1 too: the baseline of bench.py)."""
        make_layout(len(prompt_ids), self.cp, self.zigzag)        # too short: refused, engine intact
        seq = self._queue(prompt_ids, params)
        bm = self.scheduler.block_manager
        if bm.blocks_for(seq.num_prompt_tokens) > bm.num_free_blocks:
            raise RuntimeError(f"no room in the KV pool for a prompt of {seq.num_prompt_tokens} tokens")
        self._prefill_now(seq)
        return seq

    def _queue(self, prompt_ids, params) -> Sequence:
        if self.closed:
            raise RuntimeError("this CPEngine is closed (after close() or a worker failure): make a new one")
        return super().add_request(prompt_ids, params)           # checks the prompt, queues it

    def _prefill_now(self, seq: Sequence) -> None:
        self.scheduler.waiting.remove(seq)
        try:
            self.prefill(seq)
        except BaseException as e:
            raise self._fail(e) from e

    def prefill(self, seq: Sequence) -> None:
        """The whole prompt of `seq` over the cp ranks; it leaves running, with its first token."""
        T, sched = seq.num_prompt_tokens, self.scheduler
        layout = make_layout(T, self.cp, self.zigzag)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        sched.block_manager.allocate(seq, T)
        slots = torch.tensor(slot_mapping(seq.block_table, 0, T, self.kv_pool.block_size))
        where = [slots[torch.tensor(layout.positions(r))] for r in range(self.cp)]

        def kv_sink(layer: int, src: int, block: torch.Tensor) -> None:   # every block that passes by
            self.kv_pool.write(layer, where[src], block[0], block[1])

        self.jobs += 1
        for conn in self.conns:
            conn.send(("prefill", self.jobs, seq.prompt_token_ids, self.zigzag))
        tl = Timeline(0, "rank 0")
        t0 = time.perf_counter()
        with PeakMeter() as mem:
            hidden, attn = prefill_share(self.model, seq.prompt_token_ids, 0, self.cp, self.zigzag,
                                         self.ring if self.cp > 1 else None, tl, kv_sink)
            reports = [self._receive(i, "done", self.timeout_s) for i in range(self.cp - 1)]
        wall = time.perf_counter() - t0
        holder = layout.rank_of_last_token()         # zigzag: rank 0 (the last chunk is its own)
        last = hidden[-1] if holder == 0 else torch.from_numpy(reports[holder - 1]["last_hidden"]).to(hidden.dtype)
        with tl.span("sample", "sample", prompt=T):
            logits = self.compute_logits(last[None])
            token = int(self.sampler(logits, [seq.params], [seq.generator])[0])
        timelines = [tl] + [Timeline.from_dict(r["timeline"]) for r in reports]
        for t, off in zip(timelines[1:], self.offsets):
            t.offset_ns = off
        self.last_prefill = {"layout": layout, "wall_s": wall, "timelines": timelines,
                             "stats": [attn.stats] + [r["stats"] for r in reports],
                             "peak_bytes": [mem.extra] + [r["peak_bytes"] for r in reports]}
        # From here on the sequence is as if the scheduler had prefilled it (lesson 09's step).
        seq.num_computed_tokens = T
        self.counters.prompt_tokens += T
        sched.after_step(ScheduledBatch([seq], [T]))          # lesson 13: its full blocks become reusable
        seq.token_ids.append(token)
        seq.token_times.append(time.perf_counter())
        self.counters.generation_tokens += 1
        reason = seq.params.finish_reason(token, len(seq.output_token_ids), self.eos_ids)
        if reason:
            sched.finish(seq, reason)

    def measure_hops(self, sizes: list[int], repeats: int = 5) -> list[tuple[int, float]]:
        """Bare ring hops of each size in bytes, all ranks at once: (bytes, seconds) on rank 0."""
        if self.cp == 1:
            raise ValueError("a single rank has no ring to measure")
        try:
            for conn in self.conns:
                conn.send(("hops", sizes, repeats))
            mine = time_hops(self.ring, sizes, repeats)
            for i in range(self.cp - 1):
                self._receive(i, "done", self.timeout_s + 60)
            return mine
        except BaseException as e:
            raise self._fail(e) from e

    def step(self):
        if self.closed:
            raise RuntimeError("this CPEngine is closed (after close() or a worker failure): make a new one")
        return super().step()

    # ---- faults and shutdown -------------------------------------------------------------------
    def _receive(self, i: int, kind: str, timeout_s: float) -> dict:
        """Worker i's next message, which must be `kind`; its error, its death or silence raise."""
        conn, rank, deadline = self.conns[i], self.worker_set.ranks[i], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if conn.poll(0.05):
                    got, info = conn.recv()
                    if got == "error":
                        raise WorkerFailed(f"context-parallel worker failed:\n{info}")
                    if got != kind:
                        raise RuntimeError(f"rank {rank} answered {got!r}, expected {kind!r}")
                    return info
            except (EOFError, OSError) as e:
                raise WorkerFailed(f"context-parallel rank {rank} closed its connection") from e
            self.worker_set.check_alive()
        raise WorkerFailed(f"context-parallel rank {rank}: no {kind!r} within {timeout_s:.0f} s")

    def _fail(self, error: BaseException) -> BaseException:
        """Close everything; return the error to raise: the workers' account if they have one."""
        report = self.worker_set.report() if self.worker_set else ""
        self.close(wait_s=0.1)
        blamed = isinstance(error, (WorkerFailed, parallel.CollectiveError)) or "process ended" in report \
            or "Traceback" in report or "connection lost" in report
        if isinstance(error, KeyboardInterrupt) or not blamed:
            return error
        return WorkerFailed(f"context-parallel prefill failed on rank 0 with: {error}\n"
                            f"worker report:\n{report or '(none)'}")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the workers, leave the process group, restore rank 0's thread count. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._finalizer is None:               # cp == 1: no process, no group
            torch.set_num_threads(self._threads_before)
            return
        self._finalizer.detach()
        _release(self.workers, self.conns, None, self._threads_before, wait_s)
