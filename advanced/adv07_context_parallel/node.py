"""A headless node of a context-parallel run: this machine's ranks, prefilling for node 0.

    node 0:  CPEngine(..., context_parallel_size=4, launch=NodeLaunch(nnodes=2, node_rank=0,
             master_addr=H, master_port=PORT))  (or run.py --nnodes 2 ...)       ranks 0, 1
    node 1:  python -m advanced.adv07_context_parallel.node --model PATH --context-parallel-size 4 \\
                 --nnodes 2 --node-rank 1 --master-addr H --master-port PORT          ranks 2, 3

Ranks are handed out node by node (lesson 17's launch.py), so of a ring round's cp hops only
one per machine crosses the network (rank 1 -> 2 and rank 3 -> 0 above); the ring is lock-step,
so every round waits for those. Everything else is lesson 17's node.py: run_node spawns
one worker per local rank and stops them all when one fails, on Ctrl-C or SIGTERM, or when node
0 closes the engine. Exit codes as there: 0 closed by node 0, 2 rendezvous failed (never
joined, or refused for other flags, named in the message), 1 a worker failed.

Under torchrun every rank is its own process already: `run_torchrun_rank()` turns a rank other
than 0 into its CP worker in place (call it first thing, before building the engine on rank 0),
and rank 0's CPEngine reads torchrun's environment. torchrun's world must be exactly the cp ranks.
"""
from __future__ import annotations

import os
import sys

import torch

from advanced.adv07_context_parallel.worker import CPWorkerSpec, worker_main
from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import NodeLaunch, torchrun_rank
from step17_tensor_parallel.launch import check_torchrun_world as check_world
from step17_tensor_parallel.node import become_worker, node_launch, node_parser, run_node

NODE_COMMAND = "python -m advanced.adv07_context_parallel.node"


def node_specs(folder: str, cp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
               threads: int | None = None) -> list[CPWorkerSpec]:
    """The workers of this node (node 0's are spawned by CPEngine itself)."""
    ranks = launch.local_ranks(cp)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(ranks))
    return [CPWorkerSpec(folder, r, cp, launch.master_port, dtype, threads, timeout_s, False, launch.master_addr,
                         launch.nnodes, launch.rendezvous_timeout_s) for r in ranks]


def check_torchrun_world(cp: int, env=os.environ) -> None:
    """Under torchrun every process is one CP rank, so its world must be cp exactly: with more,
    the extra ranks would wait for a ring they are not in; with fewer, the ring never closes."""
    check_world(cp, f"context_parallel_size={cp} (one process per CP rank)", env)


def check_launch(cp: int, launch: NodeLaunch, env=os.environ) -> None:
    """What CPEngine (cp > 1) refuses: a torchrun world of another size, a torchrun rank other
    than 0, a node other than 0. Checked before anything is loaded or started."""
    if launch.torchrun:
        check_torchrun_world(cp, env)
        rank = torchrun_rank(env)
        if rank:
            raise ValueError(f"under torchrun CPEngine runs on rank 0; rank {rank} becomes its worker: call "
                             f"advanced.adv07_context_parallel.node.run_torchrun_rank(...) first thing")
    if launch.node_rank != 0:
        raise ValueError(f"CPEngine runs on node 0; node {launch.node_rank} runs its ranks headless: "
                         f"{NODE_COMMAND} --node-rank {launch.node_rank} ...")


def run_torchrun_rank(model: str, cp: int, dtype: torch.dtype, timeout_s: float = 60.0,
                      threads: int | None = None, exact_memory: bool = False,
                      rendezvous_timeout_s: float | None = None) -> None:
    """Under torchrun, on every rank but 0: be that rank's CP worker, then exit (0 when rank 0
    closes the engine, 1 after sending its traceback to rank 0, 2 on a failed rendezvous). On
    rank 0 it only checks torchrun's world against cp (every rank refuses a wrong one at once);
    a no-op without torchrun. timeout_s and exact_memory: as rank 0's CPEngine.
    rendezvous_timeout_s: how long the worker waits for rank 0's engine to open its control
    socket (default the launch's 60 s; more if rank 0 does other work before building it)."""
    rank = torchrun_rank()
    if rank is None:
        return
    check_torchrun_world(cp)
    if rank == 0:
        return
    specs = node_specs(str(model), cp, dtype, NodeLaunch.from_env(), timeout_s, threads or torch.get_num_threads())
    spec = next(s for s in specs if s.rank == rank)
    spec.exact_memory = exact_memory
    spec.rendezvous_timeout_s = rendezvous_timeout_s or spec.rendezvous_timeout_s
    become_worker(worker_main, spec)


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's context-parallel ranks for the engine on node 0.", "--context-parallel-size",
                    NODE_COMMAND, "how long a ring hop waits (as node 0's)")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the engine (run.py or CPEngine with launch=...)")
    try:
        specs = node_specs(str(resolve_model(args.model)), args.context_parallel_size, dtype, launch,
                           args.timeout_s, args.threads)
    except ValueError as e:
        p.error(str(e))
    print(f"[minivllm] node {launch.node_rank}: context-parallel ranks {[s.rank for s in specs]} of "
          f"{args.context_parallel_size}, rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, worker_main, "cp")


if __name__ == "__main__":
    sys.exit(main())
