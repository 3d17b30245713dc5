"""A second attention worker (2:1): its own KV pool and the attention halves of its own sequences.

    rank 0 (attention, scheduler, sampler)        peer rank (attention)           FFN rank
    split the step by owner (seq_id % 2)
    its sequences' step  ----control socket---->  embed its rows
    its own rows' layers                          its rows' layers    <==gloo==>  micro-batch i of
                                                                                  both, one matmul
    final rows  <=======gloo [T_peer, hidden]===  last layer's output
    final norm, LM head, sample (all rows)

One scheduler, one block manager: rank 0 allocates every sequence's blocks, and the peer's pool
has the same geometry, so a block id names a place in the pool of the sequence's owner. Each
pool holds only its owner's sequences' KV. The peer joins, reports and ends as an FFN process
does (lesson 17's `join_rank0` and `worker_exit`); each step it runs the same `layers` loop as
rank 0 (runner.py), over the sequences rank 0 sent it.
"""
from __future__ import annotations

import os
import pickle
import socket
from dataclasses import dataclass

import torch

from minivllm_support.timeline import Timeline, answer_offset
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import create_kv_pool
from step16_cuda_graph.cpu.engine import cpu_fast_path
from step17_tensor_parallel.worker import join_rank0, model_bytes, worker_exit
from advanced.adv06_pipeline_parallel import p2p
from advanced.adv11_afd.ffn_worker import STARTUP_TIMEOUT_S, run_flags
from advanced.adv11_afd.microbatch import split_batch
from advanced.adv11_afd.runner import AFDRunner, PeerStep
from advanced.adv11_afd.split import load_attention_side


@dataclass
class PeerSpec:
    folder: str
    rank: int
    n_attention: int
    n_ffn: int
    port: int
    dtype: torch.dtype
    threads: int
    timeout_s: float
    config: PagedSchedulerConfig          # rank 0's, block size fitted: the same pool geometry
    attention_backend: str = "auto"
    fast_path: bool = True
    master_addr: str = "127.0.0.1"
    rendezvous_timeout_s: float = 60.0

    def who(self) -> str:
        return f"attention rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"


def peer_main(spec: PeerSpec) -> None:
    """Entry point of a peer attention process (spawned by rank 0)."""
    with worker_exit(f"attention rank {spec.rank}") as state:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        flags = run_flags(spec.folder, spec.dtype, spec.n_ffn, 1, spec.n_attention)
        _, conn = join_rank0(spec.rank, spec.n_attention + spec.n_ffn, spec.port, spec.master_addr, flags,
                             spec.who(), spec.rendezvous_timeout_s, max(spec.timeout_s, STARTUP_TIMEOUT_S))
        state.conn = conn
        model = load_attention_side(spec.folder, spec.dtype)
        weights = model_bytes(model)
        model = cpu_fast_path(model) if spec.fast_path else model
        backend = choose_backend(spec.attention_backend, "cpu")
        pool = create_kv_pool(model, spec.config, backend)
        conn.send(("ready", {"weight_bytes": weights, "kv_bytes": pool.nbytes}))
        answer_offset(conn)
        tl = Timeline(spec.rank, f"attention side (rank {spec.rank})")
        runner = AFDRunner(model, pool, backend, [], spec.n_ffn, spec.timeout_s, tl)
        for _, data in p2p.control_messages(conn, tl):  # until rank 0 closes the engine
            work: PeerStep = pickle.loads(data)
            mbs = split_batch(work.batch(), work.m)     # the cut rank 0 announced to the FFN side
            out = runner.layers(mbs, torch.tensor(work.input_ids), torch.tensor(work.positions), work.step)
            with tl.span("send rows", "send", step=work.step, rows=len(out)):
                p2p.wait(p2p.isend(out.contiguous(), 0), f"last hidden rows of step {work.step} to rank 0",
                         spec.timeout_s)
