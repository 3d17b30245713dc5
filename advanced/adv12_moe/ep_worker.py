"""An expert-parallel rank: the whole model but only its experts, its own copy of the KV pool,
and lesson 17's loop: run whatever step rank 0 describes.

    worker: dial the store, then rank 0's control socket, join the process group (lesson 17's join_rank0)
    rank 0 --control--> worker: the expert placement and the router bias (once), the pool spec (once), then one
                                StepMetadata per step, b"" to stop
    worker --control--> rank 0: ("ready", facts) once, or ("error", traceback) before it exits
    all ranks <-gloo-> the dispatch and combine inside every sparse layer (ep.py)

The placement comes over the control socket, not from the worker's own arguments, so a rank
started on another machine (node.py) holds what rank 0 decided, EPLB's layout included.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from step15_flash_attention.backends import choose_backend
from step16_cuda_graph.cpu.engine import cpu_fast_path
from step17_tensor_parallel import control
from step17_tensor_parallel.metadata import MetadataAttention, StepMetadata
from step17_tensor_parallel.worker import join_rank0, model_bytes, worker_exit
from advanced.adv12_moe.eplb import Placement, placement_from_map
from advanced.adv12_moe.ep import ExpertParallel
from advanced.adv12_moe.model import load_moe_model, moe_layers, set_router_bias

@dataclass
class EPWorkerSpec:
    folder: str
    rank: int
    world: int
    port: int
    dtype: torch.dtype
    threads: int
    timeout_s: float
    fast_path: bool = True
    master_addr: str = "127.0.0.1"
    nnodes: int = 1
    rendezvous_timeout_s: float = 60.0

    def flags(self) -> control.RunFlags:
        return run_flags(self.folder, self.dtype, self.world, self.nnodes)

    def who(self) -> str:
        return f"expert-parallel rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"


def run_flags(folder: str, dtype: torch.dtype, world: int, nnodes: int) -> control.RunFlags:
    # lesson 17's fingerprint leaves out the expert sizes: two MoE checkpoints could share it
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    extra = "moe " + " ".join(f"{k}={cfg.get(k)}" for k in ("num_experts", "num_local_experts", "num_experts_per_tok",
                                                             "moe_intermediate_size"))
    return control.RunFlags(control.model_fingerprint(folder), str(dtype), world, nnodes, extra=extra)


def placements_message(placements: dict[int, Placement]) -> dict:
    return {layer: (p.physical_to_logical.tolist(), p.num_ranks) for layer, p in placements.items()}


def placements_from_message(msg: dict, num_experts: int) -> dict[int, Placement]:
    return {layer: placement_from_map(p2l, num_experts, ranks) for layer, (p2l, ranks) in msg.items()}


def prepare_rank(folder: str, dtype: torch.dtype, rank: int, world: int, placements: dict[int, Placement],
                 fast_path: bool = True, router_bias: Tensor | None = None) -> tuple[nn.Module, int]:
    """This rank's model, as the single-process engine runs it (lesson 16's fast-path transforms),
    holding only its experts, with the expert-parallel path in every sparse layer (with one
    rank: every expert, moe.py's local path)."""
    model = load_moe_model(folder, dtype, held=lambda layer: placements[layer].held_by(rank))
    weights = model_bytes(model)
    if fast_path:
        model = cpu_fast_path(model)
    set_router_bias(model, router_bias)     # the same on every rank: each routes every token
    if world > 1:
        path = ExpertParallel(rank, world, placements)
        for m in moe_layers(model):         # on the transformed model: it has its own module objects
            m.expert_path = path
    return model, weights


def ep_worker_main(spec: EPWorkerSpec) -> None:
    """Entry point of a worker rank (spawned by rank 0 or by a headless node)."""
    with worker_exit(f"expert-parallel rank {spec.rank}") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        _, conn = join_rank0(spec.rank, spec.world, spec.port, spec.master_addr, spec.flags(), spec.who(),
                             spec.rendezvous_timeout_s, spec.timeout_s)
        state.conn = conn
        placements_msg, num_experts, router_bias = conn.recv()
        placements = placements_from_message(placements_msg, num_experts)
        model, weights = prepare_rank(spec.folder, spec.dtype, spec.rank, spec.world, placements, spec.fast_path,
                                      router_bias)
        num_blocks, block_size, backend_name = conn.recv()
        backend = choose_backend(backend_name)
        pool = backend.pool_class(model.config, num_blocks, block_size, spec.dtype)
        conn.send(("ready", {"weight_bytes": weights, "kv_bytes": pool.nbytes}))
        while True:
            data = conn.recv_bytes()
            if not data:
                break                                   # rank 0 is closing the engine
            meta = StepMetadata.from_bytes(data)
            model(meta.input_ids, meta.positions, MetadataAttention(pool, meta, backend))
