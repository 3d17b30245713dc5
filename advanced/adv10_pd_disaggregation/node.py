"""A headless node: one engine of the disaggregated pair, on another machine than the launcher.

    node 0 (launcher + prefill): python advanced/adv10_pd_disaggregation/run.py --transports gloo \\
                                     --nnodes 2 --node-rank 0 --master-addr H --master-port PORT
                                 (or PDCluster(..., transport="gloo", launch=NodeLaunch(...)))
    node 1 (decode):             python -m advanced.adv10_pd_disaggregation.node --role decode --engines 2 \\
                                     --nnodes 2 --node-rank 1 --master-addr H --master-port PORT

`--role prefill` (with `--remote prefill` on node 0) puts the prefill engine here instead. The
engine dials node 0 (the store, then the launcher's control socket, remote.py), is refused if its
flags differ from node 0's (the message names the field), joins the gloo group with the other
engine and serves until the launcher closes the run; the KV crosses between the machines, layer
by layer. Everything else is lesson 17's node.py: run_node spawns the engine process and stops it
on Ctrl-C or SIGTERM. Exit codes as there: 0 closed by node 0, 2 rendezvous failed (never joined,
or refused for other flags), 1 the engine failed.
"""
from __future__ import annotations

import sys

import torch

from minivllm_support.models import resolve_model
from step17_tensor_parallel.node import node_launch, node_parser, run_node
from advanced.adv10_pd_disaggregation.remote import ROLES, NodeEngineSpec, node_engine_main


def main(argv: list[str] | None = None) -> int:
    p = node_parser("Run one engine of a prefill/decode pair for the launcher on node 0.", "--engines",
                    "python -m advanced.adv10_pd_disaggregation.node")
    p.add_argument("--role", choices=ROLES, default="decode", help="the engine this node runs (node 0 runs the "
                   "launcher and the other one)")
    args = p.parse_args(argv)
    launch, dtype = node_launch(p, args, "the launcher (run.py or PDCluster with launch=...)")
    if args.engines != 2 or launch.nnodes != 2:
        p.error(f"a prefill engine and a decode engine on 2 nodes (--engines 2 --nnodes 2), got --engines "
                f"{args.engines} --nnodes {launch.nnodes}")
    threads = args.threads or max(1, torch.get_num_threads() or 1)
    spec = NodeEngineSpec(args.role, str(resolve_model(args.model)), dtype, threads, args.role, launch.master_addr,
                          launch.master_port, launch.nnodes, launch.rendezvous_timeout_s)
    print(f"[minivllm] node {launch.node_rank}: the {args.role} engine, rendezvous at "
          f"{launch.master_addr}:{launch.master_port}", flush=True)
    return run_node([spec], node_engine_main, "pd")


if __name__ == "__main__":
    sys.exit(main())
