"""A headless node: this machine's share of the ranks, working for the engine on node 0.

    python -m step17_tensor_parallel.node --model PATH --tensor-parallel-size 2 \\
        --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500

It spawns one worker per rank of this node (launch.py decides which), each of which dials node 0
(the store, then rank 0's control socket, control.py) and serves steps until node 0 closes the
engine. Exit code: 0 when node 0 closed the run, 2 when the rendezvous failed (node 0 never came,
or refused our flags: the message says which), 1 when a worker failed. Ctrl-C or SIGTERM stops
every worker of this node; none is left behind.

Under torchrun every rank is its own process already: `run_torchrun_worker()` turns a rank other
than 0 into a worker in place (the lessons' run.py scripts call it first thing).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

import torch
import torch.multiprocessing as mp

from minivllm_support.cli import DTYPES
from minivllm_support.cpu import auto_dtype
from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import (NodeLaunch, add_launch_flags, check_torchrun_world, launch_from_args,
                                           torchrun_rank)
from step17_tensor_parallel.worker import WorkerSpec, worker_main


def worker_specs(folder: str, tp: int, dtype: torch.dtype, launch: NodeLaunch, timeout_s: float,
                 threads: int | None = None, pack_weights: bool = True) -> list[WorkerSpec]:
    ranks = launch.local_ranks(tp)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(ranks))
    return [WorkerSpec(folder, r, tp, launch.master_port, dtype, threads, timeout_s, pack_weights,
                       master_addr=launch.master_addr, nnodes=launch.nnodes,
                       rendezvous_timeout_s=launch.rendezvous_timeout_s) for r in ranks]


def run_node(specs: list, target=worker_main, name: str = "tp") -> int:
    """Spawn one worker per spec (`target(spec)`, each spec has a .rank), wait for them; the
    first one that fails stops the others. Other multi-process engines pass their own target."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(s,), name=f"{name}-rank-{s.rank}") for s in specs]
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs) and not stop:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    if stop:
        return 0
    return next((c for c in codes if c not in (0, None) and c > 0), 1 if any(c != 0 for c in codes) else 0)


def node_parser(description: str, size_flag: str, node_command: str, timeout_help: str | None = None,
                dtype_default: str = "auto") -> argparse.ArgumentParser:
    """The flags every headless node takes (the advanced lessons' node.py files too): the model,
    the engine's size, dtype, threads, an optional timeout, and the launch flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="the checkpoint folder on this machine (same model as node 0)")
    p.add_argument(size_flag, type=int, required=True, help="the engine's size in the whole run (as node 0's)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default=dtype_default, help="must match node 0's "
                   "(auto: bf16 where the CPU computes it natively, else fp32; refused at the rendezvous "
                   "if the nodes differ)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks here)")
    if timeout_help:
        p.add_argument("--timeout-s", type=float, default=60.0, help=timeout_help)
    add_launch_flags(p, node_command)
    return p


def node_launch(p: argparse.ArgumentParser, args, engine: str) -> tuple[NodeLaunch, torch.dtype]:
    """This node's launch and dtype from the flags, or a usage error naming what is wrong."""
    try:
        launch = launch_from_args(args)
    except ValueError as e:
        p.error(str(e))
    if launch.node_rank == 0:
        p.error(f"node 0 runs {engine} itself; this command is for --node-rank 1 and up")
    return launch, auto_dtype() if args.dtype == "auto" else DTYPES[args.dtype]


def become_worker(target, spec) -> None:
    """Run `target(spec)` in this process (a torchrun rank) and exit with its code."""
    try:
        target(spec)
    except SystemExit as e:
        sys.exit(e.code)
    sys.exit(0)


def run_torchrun_worker(model: str, tp: int, dtype: torch.dtype, timeout_s: float = 60.0) -> None:
    """Under torchrun, on every rank but 0: be that rank's worker, then exit. A no-op elsewhere."""
    rank = torchrun_rank()
    if rank is None:
        return
    check_torchrun_world(tp, f"tensor_parallel_size={tp}")           # on every rank, before anyone waits
    if rank == 0:
        return
    launch = NodeLaunch.from_env()
    become_worker(worker_main, WorkerSpec(str(model), rank, tp, launch.master_port, dtype, torch.get_num_threads(),
                                          timeout_s, True, master_addr=launch.master_addr, nnodes=launch.nnodes,
                                          rendezvous_timeout_s=launch.rendezvous_timeout_s))


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's tensor-parallel ranks for the engine on node 0.", "--tensor-parallel-size",
                    "python -m step17_tensor_parallel.node", "collective timeout (as node 0's)")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the engine (run.py, the LLM API or the server with --nnodes)")
    specs = worker_specs(str(resolve_model(args.model)), args.tensor_parallel_size, dtype, launch,
                         args.timeout_s, args.threads)
    print(f"[minivllm] node {launch.node_rank}: ranks {[s.rank for s in specs]} of {args.tensor_parallel_size}, "
          f"rendezvous at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs)


if __name__ == "__main__":
    sys.exit(main())
