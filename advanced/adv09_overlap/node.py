"""A headless node of the overlap engine: this machine's ranks, working for the engine on node 0.

    node 0:  python advanced/adv09_overlap/run.py --tp 2 --nnodes 2 --node-rank 0 \\
                 --master-addr H --master-port PORT          (or OverlapEngine(..., launch=NodeLaunch(...)))
    node 1:  python -m advanced.adv09_overlap.node --model PATH --tensor-parallel-size 2 \\
                 --nnodes 2 --node-rank 1 --master-addr H --master-port PORT

Lesson 17's node.py with this lesson's worker (worker.py): the same flags, the same placement of
ranks, the same exit codes (0 closed by node 0, 2 rendezvous failed, 1 a worker failed). A node
started with lesson 17's command instead is refused at the rendezvous: its flags lack the
schedule ("two-batch overlap"), and its workers could not read this engine's step messages.

Across machines the all-reduces cross the network twice per layer: the overlap has more to
hide there, and lesson 17's shared-memory all-reduce (one machine only) is not in the race.

Under torchrun every rank is its own process already: `run_torchrun_worker()` turns a rank other
than 0 into its worker in place (call it first thing, before building the engine on rank 0).
"""
from __future__ import annotations

import sys
from dataclasses import fields

import torch

from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world, torchrun_rank
from step17_tensor_parallel.node import become_worker, node_launch, node_parser, run_node, worker_specs
from advanced.adv09_overlap.worker import OverlapSpec, overlap_worker_main


def overlap_specs(folder: str, tp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
                  threads: int | None = None) -> list[OverlapSpec]:
    """Lesson 17's specs for this node's ranks, as this lesson's worker takes them."""
    return [OverlapSpec(**{f.name: getattr(s, f.name) for f in fields(s)})
            for s in worker_specs(folder, tp, dtype, launch, timeout_s, threads)]


def run_torchrun_worker(model: str, tp: int, dtype: torch.dtype, timeout_s: float = 60.0) -> None:
    """Under torchrun, on every rank but 0: be that rank's worker, then exit. A no-op elsewhere."""
    rank = torchrun_rank()
    if rank is None:
        return
    check_torchrun_world(tp, f"tensor_parallel_size={tp}")
    if rank == 0:
        return
    specs = overlap_specs(str(model), tp, dtype, NodeLaunch.from_env(), timeout_s, torch.get_num_threads())
    become_worker(overlap_worker_main, next(s for s in specs if s.rank == rank))


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's ranks of the two-batch-overlap engine on node 0.", "--tensor-parallel-size",
                    "python -m advanced.adv09_overlap.node", "collective timeout (as node 0's)")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the engine (run.py or OverlapEngine with launch=...)")
    specs = overlap_specs(str(resolve_model(args.model)), args.tensor_parallel_size, dtype, launch,
                          args.timeout_s, args.threads)
    print(f"[minivllm] node {launch.node_rank}: ranks {[s.rank for s in specs]} of {args.tensor_parallel_size} "
          f"(two-batch overlap), rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, overlap_worker_main, "tbo")


if __name__ == "__main__":
    sys.exit(main())
