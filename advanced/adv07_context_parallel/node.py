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

import sys

import torch

from advanced.adv07_context_parallel.worker import CPWorkerSpec, worker_main
from minivllm_support.models import resolve_model
from step18_tensor_parallel.launch import NodeLaunch
from step18_tensor_parallel.node import node_launch, node_parser, run_node


def node_specs(folder: str, cp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
               threads: int | None = None) -> list[CPWorkerSpec]:
    """The workers of this node (node 0's are spawned by CPEngine itself)."""
    ranks = launch.local_ranks(cp)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(ranks))
    return [CPWorkerSpec(folder, r, cp, launch.master_port, dtype, threads, timeout_s, False, launch.master_addr,
                         launch.nnodes, launch.rendezvous_timeout_s) for r in ranks]


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's context-parallel ranks for the engine on node 0.", "--context-parallel-size",
                    "python -m advanced.adv07_context_parallel.node", "how long a ring hop waits (as node 0's)")
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
