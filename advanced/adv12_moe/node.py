"""A headless node of an expert-parallel engine: this machine's ranks, working for node 0.

    node 0:  python advanced/adv12_moe/run.py --ep 4 --nnodes 2 --node-rank 0 \\
                 --master-addr H --master-port PORT        (or EPEngine(..., launch=NodeLaunch(...)))
    node 1:  python -m advanced.adv12_moe.node --model PATH --expert-parallel-size 4 \\
                 --nnodes 2 --node-rank 1 --master-addr H --master-port PORT

Everything is lesson 17's: its flags, its rank placement (consecutive ranks on a node), its
`run_node` (one worker per local rank; all stop when one fails, on Ctrl-C or SIGTERM, or when
node 0 closes the engine) and its exit codes (0 closed by node 0, 2 rendezvous failed, 1 a
rank failed). What a rank holds is not decided here: node 0 sends every rank its placement
(which experts, EPLB's replicas included) over the control socket once it has joined.

Under torchrun every rank is its own process already: `run_torchrun_ep_worker()` turns a rank
other than 0 into its worker in place (call it first thing, before building the engine on rank 0).
"""
from __future__ import annotations

import sys

import torch

from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world, torchrun_rank
from step17_tensor_parallel.node import become_worker, node_launch, node_parser, run_node
from advanced.adv12_moe.ep_worker import EPWorkerSpec, ep_worker_main


def ep_specs(folder: str, ep: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
             threads: int | None = None) -> list[EPWorkerSpec]:
    ranks = [r for r in launch.local_ranks(ep) if r != 0]
    threads = threads or max(1, (torch.get_num_threads() or 1) // max(1, len(ranks)))
    return [EPWorkerSpec(folder, r, ep, launch.master_port, dtype, threads, timeout_s, True, launch.master_addr,
                         launch.nnodes, launch.rendezvous_timeout_s) for r in ranks]


def run_torchrun_ep_worker(model: str, ep: int, dtype: torch.dtype, timeout_s: float = 60.0) -> None:
    """Under torchrun, on every rank but 0: be that rank's worker, then exit. A no-op elsewhere."""
    rank = torchrun_rank()
    if rank is None:
        return
    check_torchrun_world(ep, f"expert_parallel_size={ep}")
    if rank == 0:
        return
    spec = next(s for s in ep_specs(str(model), ep, dtype, NodeLaunch.from_env(), timeout_s, torch.get_num_threads())
                if s.rank == rank)
    become_worker(ep_worker_main, spec)


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's expert-parallel ranks for the engine on node 0.", "--expert-parallel-size",
                    "python -m advanced.adv12_moe.node", "collective timeout (as node 0's)")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the engine (run.py or EPEngine with launch=...)")
    if args.model is None:
        p.error("--model is needed: the Qwen3-MoE checkpoint folder on this machine (the same model as node 0's)")
    try:
        specs = ep_specs(str(resolve_model(args.model)), args.expert_parallel_size, dtype, launch, args.timeout_s,
                         args.threads)
    except ValueError as e:
        p.error(str(e))
    print(f"[minivllm] node {launch.node_rank}: expert-parallel ranks {[s.rank for s in specs]} of "
          f"{args.expert_parallel_size}, rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, ep_worker_main, "ep")


if __name__ == "__main__":
    sys.exit(main())
