"""A headless node of a pipeline: this machine's stages, working for the engine on node 0.

    node 0:  python advanced/adv06_pipeline_parallel/run.py --pp 4 --nnodes 2 --node-rank 0 \
                 --master-addr H --master-port PORT       (or PPEngine(..., launch=NodeLaunch(...)))
                                                                                       stages 0 .. p/2-1
    node 1:  python -m advanced.adv06_pipeline_parallel.node --model PATH --pipeline-parallel-size 4 \\
                 --nnodes 2 --node-rank 1 --master-addr H --master-port PORT          stages p/2 .. p-1

Stages are ranks, and lesson 18's placement(tp=1, pp=p, nnodes) puts consecutive ones on a
node: only one hidden state per micro-batch crosses between the machines (and the last stage's
sampled rows go back to rank 0). Everything else is lesson 18's node.py: run_node spawns one
worker per local stage and stops them all when one fails, on Ctrl-C or SIGTERM, or when node 0
closes the engine. Exit codes as there: 0 closed by node 0, 2 rendezvous failed (never joined,
or refused for other flags, named in the message), 1 a stage failed.

Under torchrun every rank is its own process already: `run_torchrun_stage()` turns a rank other
than 0 into its stage in place (call it first thing, before building the engine on rank 0).
"""
from __future__ import annotations

import argparse
import sys

import torch

from minivllm_support.cli import DTYPES
from minivllm_support.cpu import auto_dtype
from minivllm_support.models import resolve_model
from step04_transformer.config import ModelConfig
from step18_tensor_parallel.launch import NodeLaunch, add_launch_flags, launch_from_args, torchrun_rank
from step18_tensor_parallel.node import run_node
from advanced.adv06_pipeline_parallel.partition import partition_layers
from advanced.adv06_pipeline_parallel.stage import Stage
from advanced.adv06_pipeline_parallel.worker import StageSpec, stage_worker_main


def stage_specs(folder: str, pp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
                threads: int | None = None, layer_partition=None, fast_path: bool = True) -> list[StageSpec]:
    """The specs of this node's stages, cut by the same rule as node 0's engine (partition.py)."""
    bounds = partition_layers(ModelConfig.from_pretrained(folder).num_layers, pp, layer_partition)
    ranks = launch.local_ranks(pp)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(ranks))
    layers = ",".join(str(b - a) for a, b in bounds)
    return [StageSpec(folder, Stage(r, pp, *bounds[r]), launch.master_port, dtype, threads, timeout_s, fast_path,
                      layers, launch.master_addr, launch.nnodes, launch.rendezvous_timeout_s) for r in ranks]


def run_torchrun_stage(model: str, pp: int, dtype: torch.dtype, timeout_s: float = 60.0,
                       layer_partition=None) -> None:
    """Under torchrun, on every rank but 0: be that rank's stage, then exit. A no-op elsewhere
    (call it first thing, before building the engine, as lesson 18's run_torchrun_worker)."""
    rank = torchrun_rank()
    if rank is None or rank == 0:
        return
    specs = stage_specs(str(model), pp, dtype, NodeLaunch.from_env(), timeout_s, torch.get_num_threads(),
                        layer_partition)
    spec = next(s for s in specs if s.rank == rank)
    try:
        stage_worker_main(spec)
    except SystemExit as e:
        sys.exit(e.code)
    sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run this machine's pipeline stages for the engine on node 0.")
    p.add_argument("--model", default=None, help="the checkpoint folder on this machine (same model as node 0)")
    p.add_argument("--pipeline-parallel-size", type=int, required=True)
    p.add_argument("--partition", default=None, help="layers per stage, e.g. 13,17 (as node 0's; default: "
                   "partition.py's rule; refused at the rendezvous if the nodes differ)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="must match node 0's "
                   "(auto: bf16 where the CPU computes it natively, else fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage (default: cores / stages)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="how long a stage waits for its upstream one")
    add_launch_flags(p)
    args = p.parse_args(argv)
    launch = launch_from_args(args)
    if launch.node_rank == 0:
        p.error("node 0 runs the engine itself (run.py or PPEngine with launch=...); "
                "this command is for --node-rank 1 and up")
    dtype = auto_dtype() if args.dtype == "auto" else DTYPES[args.dtype]
    try:
        specs = stage_specs(str(resolve_model(args.model)), args.pipeline_parallel_size, dtype, launch,
                            args.timeout_s, args.threads, args.partition)
    except ValueError as e:
        p.error(str(e))
    print(f"[minivllm] node {launch.node_rank}: pipeline stages {[s.rank for s in specs]} of "
          f"{args.pipeline_parallel_size}, rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, stage_worker_main, "pp")


if __name__ == "__main__":
    sys.exit(main())
