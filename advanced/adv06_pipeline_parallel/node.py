"""A headless node of a pipeline: this machine's stages, working for the engine on node 0.

    node 0:  python advanced/adv06_pipeline_parallel/run.py --pp 4 --nnodes 2 --node-rank 0 \
                 --master-addr H --master-port PORT       (or PPEngine(..., launch=NodeLaunch(...)))
                                                                                       stages 0 .. p/2-1
    node 1:  python -m advanced.adv06_pipeline_parallel.node --model PATH --pipeline-parallel-size 4 \\
                 --nnodes 2 --node-rank 1 --master-addr H --master-port PORT          stages p/2 .. p-1

Stages are ranks, and lesson 17's placement(tp=1, pp=p, nnodes) puts consecutive ones on a
node: only one hidden state per micro-batch crosses between the machines (and the last stage's
sampled rows go back to rank 0). Everything else is lesson 17's node.py: run_node spawns one
worker per local stage and stops them all when one fails, on Ctrl-C or SIGTERM, or when node 0
closes the engine. Exit codes as there: 0 closed by node 0, 2 rendezvous failed (never joined,
or refused for other flags, named in the message), 1 a stage failed.

Under torchrun every rank is its own process already: `run_torchrun_stage()` turns a rank other
than 0 into its stage in place (call it first thing, before building the engine on rank 0).
"""
from __future__ import annotations

import sys

import torch

from minivllm_support.models import resolve_model
from step04_transformer.config import ModelConfig
from step17_tensor_parallel.launch import NodeLaunch, check_torchrun_world, torchrun_rank
from step17_tensor_parallel.model import local_config
from step17_tensor_parallel.node import become_worker, node_launch, node_parser, run_node
from advanced.adv06_pipeline_parallel.partition import partition_layers
from advanced.adv06_pipeline_parallel.stage import Stage
from advanced.adv06_pipeline_parallel.worker import StageSpec, stage_worker_main


def stage_specs(folder: str, pp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float = 60.0,
                threads: int | None = None, layer_partition=None, fast_path: bool = True, tp: int = 1) -> list[StageSpec]:
    """The specs of this node's ranks, cut by the same rule as node 0's engine (partition.py);
    rank r is TP rank r % tp of stage r // tp (lesson 17's placement)."""
    cfg = ModelConfig.from_pretrained(folder)
    local_config(cfg, tp)                                     # refuses a model tp cannot split
    bounds = partition_layers(cfg.num_layers, pp, layer_partition)
    ranks = launch.local_ranks(pp * tp)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(ranks))
    layers = ",".join(str(b - a) for a, b in bounds)
    return [StageSpec(folder, Stage(r // tp, pp, *bounds[r // tp]), launch.master_port, dtype, threads, timeout_s,
                      fast_path, layers, launch.master_addr, launch.nnodes, launch.rendezvous_timeout_s, tp, r % tp)
            for r in ranks]


def run_torchrun_stage(model: str, pp: int, dtype: torch.dtype, timeout_s: float = 60.0,
                       layer_partition=None, tp: int = 1) -> None:
    """Under torchrun, on every rank but 0: be that rank's stage, then exit. A no-op elsewhere
    (call it first thing, before building the engine, as lesson 17's run_torchrun_worker)."""
    rank = torchrun_rank()
    if rank is None:
        return
    check_torchrun_world(pp * tp, f"pipeline_parallel_size={pp} x tensor_parallel_size={tp}")
    if rank == 0:
        return
    specs = stage_specs(str(model), pp, dtype, NodeLaunch.from_env(), timeout_s, torch.get_num_threads(),
                        layer_partition, tp=tp)
    become_worker(stage_worker_main, next(s for s in specs if s.rank == rank))


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's pipeline stages for the engine on node 0.", "--pipeline-parallel-size",
                    "python -m advanced.adv06_pipeline_parallel.node", "how long a stage waits for its upstream one")
    p.add_argument("--partition", default=None, help="layers per stage, e.g. 13,17 (as node 0's; default: "
                   "partition.py's rule; refused at the rendezvous if the nodes differ)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per stage (as node 0's): TP x PP")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the engine (run.py or PPEngine with launch=...)")
    try:
        specs = stage_specs(str(resolve_model(args.model)), args.pipeline_parallel_size, dtype, launch,
                            args.timeout_s, args.threads, args.partition, tp=args.tensor_parallel_size)
    except ValueError as e:
        p.error(str(e))
    print(f"[minivllm] node {launch.node_rank}: ranks {[s.rank for s in specs]} (stages "
          f"{sorted({s.stage.index for s in specs})} of {args.pipeline_parallel_size}, tensor parallel "
          f"{args.tensor_parallel_size}), rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, stage_worker_main, "pp")


if __name__ == "__main__":
    sys.exit(main())
