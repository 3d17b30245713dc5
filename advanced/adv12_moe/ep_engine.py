"""Lesson 16's MoE engine over `expert_parallel_size` processes, each holding some experts.

    user process = rank 0                              ranks 1 .. ep-1 (spawned by rank 0, by a
    scheduler, block manager, sequences, sampler       headless node, or by torchrun: node.py)
    the model but only its experts, a whole KV pool    the same, with their experts
    start:   lesson 17's rendezvous (WorkerSet): every rank dials in with the same flags,
             receives the placement (which physical expert slots it holds), loads, says ready
    step():  schedule
             metadata ---- control socket, one message ---> receive
             forward: attention on every rank (replicated); in each sparse layer
                      <==== all-to-all dispatch, experts, all-to-all combine, all-gather ====>
             logits and sampling on rank 0

Attention is replicated: every rank runs it for all tokens over its own copy of the KV pool,
so rank 0's block tables are valid everywhere (as in lesson 17) and only the experts are split.
Faults end as lesson 17's do: a killed or failing worker makes rank 0's next collective fail
within milliseconds, rank 0 adds the workers' own account, stops them all and raises WorkerFailed.
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from minivllm_support.models import check_model_dir
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import Engine, create_kv_pool, create_scheduler, fit_block_size
from step16_cuda_graph.cpu.engine import KernelSampler
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import TPRunner, _release
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world
from step17_tensor_parallel.workers import WorkerFailed, WorkerSet
from advanced.adv12_moe.config import MoEConfig
from advanced.adv12_moe.eplb import Placement, static_placement
from advanced.adv12_moe.ep_worker import EPWorkerSpec, ep_worker_main, placements_message, prepare_rank, run_flags


def check_placements(cfg: MoEConfig, ep: int, placements: dict[int, Placement] | None) -> dict[int, Placement]:
    """One placement per sparse layer, for `ep` ranks (default: experts in order, no replicas)."""
    if placements is None:
        return {layer: static_placement(cfg.num_experts, ep) for layer in cfg.sparse_layers}
    if sorted(placements) != cfg.sparse_layers:
        raise ValueError(f"placements are given for layers {sorted(placements)}; the sparse layers are "
                         f"{cfg.sparse_layers}")
    for layer, p in placements.items():
        if p.num_ranks != ep or len(p.replica_counts) != cfg.num_experts:
            raise ValueError(f"layer {layer}'s placement is for {p.num_ranks} ranks and {len(p.replica_counts)} "
                             f"experts; the engine has {ep} ranks and the model {cfg.num_experts} experts")
    return placements


class EPEngine(Engine):
    def __init__(self, model: str | Path, scheduler: PagedSchedulerConfig | None = None, *,
                 expert_parallel_size: int = 2, placements: dict[int, Placement] | None = None,
                 dtype: torch.dtype = torch.bfloat16, threads_per_rank: int | None = None, timeout_s: float = 60.0,
                 fast_path: bool = True, router_bias: torch.Tensor | None = None, launch: NodeLaunch | None = None):
        """model: a Qwen3-MoE checkpoint folder. placements: {sparse layer: eplb.Placement}
        (rebalance_experts' output; default: static_placement). launch: where the ranks run
        (lesson 17's NodeLaunch; default: this machine). fast_path: lesson 16's model transforms.
        router_bias: [sparse layers, E] added to the router logits on every rank (model.set_router_bias:
        a skewed router for measurements). timeout_s: how long a collective waits for a silent rank
        before it fails (lesson 17's)."""
        folder = check_model_dir(Path(model))
        cfg, ep = MoEConfig.from_pretrained(folder), expert_parallel_size
        if ep < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {ep}")
        self.placements = check_placements(cfg, ep, placements)       # before any process starts
        if ep > 1 and dist.is_initialized():
            raise RuntimeError("this process already runs a process group (a TP, PP or EP engine): close() it first")
        self.launch = launch = launch or NodeLaunch.from_env() or NodeLaunch()
        if ep > 1 and launch.torchrun:
            check_torchrun_world(ep, f"expert_parallel_size={ep}")
        if ep > 1 and launch.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {launch.node_rank} runs its ranks headless: "
                             f"python -m advanced.adv12_moe.node --node-rank {launch.node_rank} ...")
        self.ep, self.timeout_s, self.closed = ep, timeout_s, False
        self.workers, self.conns, self.rank_memory = [], [], []
        self._threads_before = torch.get_num_threads()
        ranks_here = len(launch.local_ranks(ep)) if ep > 1 else 1
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks_here)
        torch.set_num_threads(threads)
        try:
            if ep > 1:
                self.worker_set = ws = WorkerSet(launch, ep, "ep", "expert-parallel")
                self.workers, self.conns = ws.procs, ws.conns
                for rank in ws.local_ranks():
                    ws.spawn(rank, ep_worker_main, EPWorkerSpec(str(folder), rank, ep, ws.port, dtype, threads,
                                                                timeout_s, fast_path, launch.master_addr,
                                                                launch.nnodes, launch.rendezvous_timeout_s))
                # Runs at garbage collection or at interpreter exit, unless close() ran first.
                self._finalizer = weakref.finalize(self, _release, self.workers, self.conns, None,
                                                   self._threads_before)
                ws.accept(run_flags(str(folder), dtype, ep, launch.nnodes))
                if launch.multi_node or launch.torchrun:
                    nodes = {n: [r for r in range(ep) if launch.node_of(r, ep) == n] for n in range(launch.nnodes)}
                    print(f"[minivllm] all {ep} expert-parallel ranks joined; ranks per node: {nodes}", flush=True)
                parallel.init_group(ws.store, 0, ep, timeout_s)
                for conn in self.conns:
                    conn.send((placements_message(self.placements), cfg.num_experts, router_bias))
            model, weights = prepare_rank(str(folder), dtype, 0, ep, self.placements, fast_path, router_bias)
            attention = choose_backend("auto", "cpu")
            config = fit_block_size(scheduler or PagedSchedulerConfig(), attention)
            pool = create_kv_pool(model, config, attention)
            super().__init__(model, create_scheduler(config, pool.num_blocks), pool, attention,
                             TPRunner(model, self.conns), KernelSampler())
            self.rank_memory.append({"weight_bytes": weights, "kv_bytes": pool.nbytes})
            for conn in self.conns:
                conn.send((pool.num_blocks, pool.block_size, attention.name))
            if ep > 1:
                self.rank_memory += ws.wait_ready()
        except BaseException as e:
            raise self._fail(e) from e

    def step(self):
        if self.closed:
            raise RuntimeError("this EPEngine is closed (after close() or a worker failure): make a new one")
        try:
            if self.ep > 1:
                self.worker_set.check_alive()
            return super().step()
        except BaseException as e:
            raise self._fail(e) from e

    def _fail(self, error: BaseException) -> BaseException:
        """Close everything; return the error to raise: the workers' own account if they have one."""
        report = self.worker_set.report() if hasattr(self, "worker_set") else ""
        self.close(wait_s=0.1)            # they are mid-step: no point waiting for a clean stop
        blamed = isinstance(error, (WorkerFailed, parallel.CollectiveError)) or "process ended" in report \
            or "Traceback" in report or "connection lost" in report
        if isinstance(error, KeyboardInterrupt) or not blamed:
            return error
        return WorkerFailed(f"expert-parallel step failed on rank 0 with: {error}\n"
                            f"worker report:\n{report or '(none)'}")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the workers, leave the process group, restore rank 0's thread count. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        _release(self.workers, self.conns, None, self._threads_before, wait_s)
