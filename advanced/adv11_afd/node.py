"""A headless FFN node: this machine's FFN processes, working for the attention side on node 0.

    node 0 (attention):  python advanced/adv11_afd/run.py --ffn 1 --nnodes 2 --node-rank 0 \\
                             --master-addr H --master-port PORT     (or AFDEngine(..., launch=NodeLaunch(...)))
    node 1 (FFN):        python -m advanced.adv11_afd.node --model PATH --num-ffn 1 \\
                             --nnodes 2 --node-rank 1 --master-addr H --master-port PORT

Rank 0 is the attention side; ranks 1 .. n_ffn are FFN processes, and lesson 17's rule
(`launch.local_ranks`) decides which of them run here: with 2 nodes and one FFN process, node 1
holds it, so every layer's hidden states cross between the machines, which is how the two
sides are deployed. Everything else is lesson 17's node.py: run_node spawns one process per
local rank and stops them all when one fails, on Ctrl-C or SIGTERM, or when node 0 closes the
engine. Exit codes as there: 0 closed by node 0, 2 rendezvous failed (never joined, or refused
for other flags, named in the message), 1 an FFN process failed.
"""
from __future__ import annotations

import sys

import torch

from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.node import node_launch, node_parser, run_node
from advanced.adv11_afd.ffn_worker import FFNSpec, ffn_worker_main


def ffn_specs(folder: str, n_ffn: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
              threads: int | None = None) -> list[FFNSpec]:
    """The specs of this node's FFN ranks (never rank 0: the attention side runs on node 0)."""
    ranks = [r for r in launch.local_ranks(1 + n_ffn) if r != 0]
    threads = threads or max(1, (torch.get_num_threads() or 1) // max(1, len(ranks)))
    return [FFNSpec(folder, r, n_ffn, launch.master_port, dtype, threads, timeout_s, True, launch.master_addr,
                    launch.nnodes, launch.rendezvous_timeout_s) for r in ranks]


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's FFN processes for the attention side on node 0.", "--num-ffn",
                    "python -m advanced.adv11_afd.node", "how long an FFN process waits for a hidden state")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the attention side (run.py or AFDEngine with launch=...)")
    specs = ffn_specs(str(resolve_model(args.model)), args.num_ffn, dtype, launch, args.timeout_s, args.threads)
    if not specs:
        p.error(f"node {launch.node_rank} of {launch.nnodes} holds none of the {args.num_ffn} FFN rank(s)")
    print(f"[minivllm] node {launch.node_rank}: FFN ranks {[s.rank for s in specs]} of {args.num_ffn}, "
          f"rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, ffn_worker_main, "afd")


if __name__ == "__main__":
    sys.exit(main())
