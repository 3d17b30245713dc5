"""A headless node: this machine's data-parallel replicas, serving the front end on node 0.

    node 0:  the front end (DPFrontEnd / build_dp_server with launch=NodeLaunch(nnodes=2, ...))
             + replicas 0 .. k-1
    node 1:  python -m advanced.adv08_data_parallel.node --model PATH --data-parallel-size 4 \\
                 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500
             + replicas k .. 2k-1           (k = data-parallel size / nnodes)

vLLM's shape: node 0 runs the API server and its local engines; the others run `--headless`
engines that dial node 0 (--data-parallel-address, --data-parallel-start-rank). Here each
replica dials the front end through lesson 17's store and control socket; the model (by its
fingerprint), the dtype and the data-parallel size must match node 0's or the replica is refused
with the field named. The KV size and threads are this machine's own business.

Exit code (lesson 17's node.py, whose run_node this is): 0 when the front end closed, 2 when the
rendezvous failed (no front end, or our flags refused), 1 when a replica failed. Ctrl-C or
SIGTERM stops every replica of this node.

Under torchrun every rank is its own process already: rank 0 is the front end (DPFrontEnd reads
torchrun's environment) and `run_torchrun_replica()` turns every other rank r into replica r-1 in
place (call it first thing), so nnodes x nproc-per-node = data-parallel size + 1 (placement.py).
"""
from __future__ import annotations

import sys

import torch

from advanced.adv08_data_parallel.placement import check_torchrun_world, local_replicas
from advanced.adv08_data_parallel.replica import ReplicaSpec, replica_main
from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import NodeLaunch, torchrun_rank
from step17_tensor_parallel.node import become_worker, node_launch, node_parser, run_node


def replica_specs(folder: str, num_replicas: int, dtype: torch.dtype, launch: NodeLaunch, *, threads: int | None = None,
                  max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 128 * 2**20,
                  enforce_eager: bool = True) -> list[ReplicaSpec]:
    """One spec per replica this node runs; threads default to this machine's cores shared out."""
    here = local_replicas(num_replicas, launch)
    threads = threads or max(1, (torch.get_num_threads() or 1) // len(here))
    return [replica_spec(i, num_replicas, folder, dtype, launch, threads, max_num_seqs, max_num_batched_tokens,
                         kv_cache_bytes, enforce_eager) for i in here]


def replica_spec(index: int, num_replicas: int, folder: str, dtype: torch.dtype, launch: NodeLaunch, threads: int,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 128 * 2**20,
                 enforce_eager: bool = True) -> ReplicaSpec:
    """Replica `index`, dialling the front end where `launch` says node 0 is."""
    return ReplicaSpec(index, num_replicas, folder, dtype, threads, max_num_seqs, max_num_batched_tokens,
                       kv_cache_bytes, enforce_eager, master_addr=launch.master_addr, port=launch.master_port,
                       nnodes=launch.nnodes, rendezvous_timeout_s=launch.rendezvous_timeout_s)


def run_torchrun_replica(model: str, data_parallel_size: int, dtype: torch.dtype, *, threads: int | None = None,
                         **options) -> None:
    """Under torchrun, on every rank r but 0: be replica r-1, then exit. A no-op elsewhere (call it
    first thing, before building the front end on rank 0, as lesson 17's run_torchrun_worker).
    options: replica_spec's (max_num_seqs, max_num_batched_tokens, kv_cache_bytes, enforce_eager),
    each rank's own like node.py's flags; model, dtype and size are checked against rank 0's."""
    rank = torchrun_rank()
    if rank is None or rank == 0:
        return
    try:
        check_torchrun_world(data_parallel_size)
    except ValueError as e:     # refused here and on rank 0: nobody waits out the rendezvous timeout
        print(f"[minivllm] rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    spec = replica_spec(rank - 1, data_parallel_size, str(model), dtype, NodeLaunch.from_env(),
                        threads or torch.get_num_threads(), **options)
    become_worker(replica_main, spec)


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run this machine's data-parallel replicas for the front end on node 0.", "--data-parallel-size",
                    "python -m advanced.adv08_data_parallel.node", dtype_default="fp32")   # DPFrontEnd's default
    p.add_argument("--kv-mib", type=int, default=128, help="KV pool of each replica here")
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args(argv)
    if args.data_parallel_size < 1:
        p.error(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    launch, dtype = node_launch(p, args, "the front end (DPFrontEnd or build_dp_server with launch=...)")
    try:
        specs = replica_specs(str(resolve_model(args.model)), args.data_parallel_size, dtype, launch,
                              threads=args.threads, max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_mib * 2**20)
    except ValueError as e:
        p.error(str(e))
    print(f"[minivllm] node {launch.node_rank}: replicas {[s.index for s in specs]} of {args.data_parallel_size}, "
          f"front end at {launch.master_addr}:{launch.master_port}", flush=True)
    return run_node(specs, replica_main, name="dp")


if __name__ == "__main__":
    sys.exit(main())
