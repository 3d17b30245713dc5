"""A headless node of a context-parallel run: this machine's ranks, prefilling for node 0.

    node 0:  CPEngine(..., context_parallel_size=4, launch=NodeLaunch(nnodes=2, node_rank=0,
             master_addr=H, master_port=PORT))  (or run.py --nnodes 2 ...)       ranks 0, 1
    node 1:  python -m advanced.adv07_context_parallel.node --model PATH --context-parallel-size 4 \\
                 --nnodes 2 --node-rank 1 --master-addr H --master-port PORT          ranks 2, 3

Ranks are handed out node by node (lesson 18's launch.py), so of a ring round's cp hops only
one per machine crosses the network (rank 1 -> 2 and rank 3 -> 0 above); the ring is lock-step,
so every round waits for those. Everything else is lesson 18's node.py: run_node spawns
one worker per local rank and stops them all when one fails, on Ctrl-C or SIGTERM, or when node
0 closes the engine. Exit codes as there: 0 closed by node 0, 2 rendezvous failed (never
joined, or refused for other flags, named in the message), 1 a worker failed.
"""
from __future__ import annotations

import argparse
import sys

import torch

from advanced.adv07_context_parallel.worker import CPWorkerSpec, worker_main
from minivllm_support.cli import DTYPES
from minivllm_support.cpu import auto_dtype
from minivllm_support.models import resolve_model
from step18_tensor_parallel.launch import NodeLaunch, add_launch_flags, launch_from_args
from step18_tensor_parallel.node import run_node


def node_specs(folder: str, cp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
               threads: int | None = None) -> list[CPWorkerSpec]:
    """The workers of this node (node 0's are spawned by CPEngine itself)."""
    ranks = launch.local_ranks(cp)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(ranks))
    return [CPWorkerSpec(folder, r, cp, launch.master_port, dtype, threads, timeout_s, False, launch.master_addr,
                         launch.nnodes, launch.rendezvous_timeout_s) for r in ranks]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run this machine's context-parallel ranks for the engine on node 0.")
    p.add_argument("--model", default=None, help="the checkpoint folder on this machine (same model as node 0)")
    p.add_argument("--context-parallel-size", type=int, required=True)
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="must match node 0's "
                   "(auto: bf16 where the CPU computes it natively, else fp32; refused at the rendezvous "
                   "if the nodes differ)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="how long a ring hop waits (as node 0's)")
    add_launch_flags(p, "python -m advanced.adv07_context_parallel.node")
    args = p.parse_args(argv)
    launch = launch_from_args(args)
    if launch.node_rank == 0:
        p.error("node 0 runs the engine itself (run.py or CPEngine with launch=...); "
                "this command is for --node-rank 1 and up")
    dtype = auto_dtype() if args.dtype == "auto" else DTYPES[args.dtype]
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
