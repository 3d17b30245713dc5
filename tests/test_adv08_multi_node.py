"""Advanced lesson 08 across machines, played on one: node 1 is `python -m
advanced.adv08_data_parallel.node`, its own process tree, and its replica dials node 0's front end
through lesson 18's control channel. The two serve one engine's tokens; when node 1 is killed only
its requests fail and node 0 serves on; a node started with other flags is refused, naming the field."""
from __future__ import annotations

import asyncio

import pytest
import torch

from advanced.adv08_data_parallel.frontend import DPFrontEnd
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step18_tensor_parallel.control import RendezvousError
from step18_tensor_parallel.launch import NodeLaunch
from step19_benchmark.faults import EngineDead
from step20_real_model.engine import LogprobsEngine
from tests.processes import free_port, gone, kill_tree, new_children, our_children, start_node
from tests.test_adv08_data_parallel import WAIT_S, _greedy, _run, _tokens


def _node1(folder, port: int, *extra: str):
    return start_node("advanced.adv08_data_parallel.node", folder, port, "--data-parallel-size", "2",
                      "--kv-mib", "16", *extra)


def _two_nodes(folder, port: int, **kw) -> DPFrontEnd:
    launch = NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)
    return DPFrontEnd(folder, 2, "round_robin", dtype=torch.float32, kv_cache_bytes=16 * 2**20, launch=launch, **kw)


def test_two_nodes_serve_one_engines_tokens_then_node1_dies_and_only_its_requests_fail(tiny_qwen3_dir):
    before = {p.pid for p in our_children()}
    prompts = [[5, 9, 33, 7] * 5, list(range(40, 57)), [3, 4], [11] * 9]
    engine = LogprobsEngine(tiny_qwen3_dir, PagedSchedulerConfig(kv_cache_bytes=16 * 2**20), dtype=torch.float32,
                            threads_per_rank=1, use_graph=False)
    try:
        expected = [s.output_token_ids for s in engine.generate(prompts, _greedy(6))]
    finally:
        engine.close()
    port = free_port()
    node1 = _node1(tiny_qwen3_dir, port)
    try:
        with _two_nodes(tiny_qwen3_dir, port) as front:
            rep0, rep1 = front._pool.replicas
            assert rep0.proc is not None and rep1.proc is None and rep1.node == 1   # replica 1: node 1's

            async def all_at_once():
                return await asyncio.gather(*(_tokens(front, p, 6) for p in prompts))
            assert _run(all_at_once()) == expected and front.routed() == [2, 2]

            async def killed_midway():                      # replica 1's (round robin): tokens, then the error
                got = []
                with pytest.raises(EngineDead, match=r"replica 1 died.*node 1: connection lost"):
                    async for e in front.generate([3] * 8, _greedy(400)):
                        got.append(e.token_id)
                        if len(got) == 2:
                            kill_tree(node1)                 # the whole machine goes
                return got
            assert _run(_tokens(front, [7] * 8))             # replica 0
            assert len(_run(killed_midway())) >= 2
            assert front.alive() == [True, False]
            assert _run(_tokens(front, [8] * 8)) and front.routed() == [4, 3]   # node 0 serves on
    finally:
        kill_tree(node1)
    assert new_children(before, WAIT_S) == set()


def test_a_node_with_other_flags_is_refused_naming_the_field(tiny_qwen3_dir):
    before = {p.pid for p in our_children()}
    port = free_port()
    bad = _node1(tiny_qwen3_dir, port, "--dtype", "bf16")     # node 0 runs fp32 (the last flag wins)
    try:
        with pytest.raises(RendezvousError, match="dtype: node 0 has 'torch.float32', this node has 'torch.bfloat16'"):
            _two_nodes(tiny_qwen3_dir, port)
        out = gone(bad)
        assert bad.returncode == 2 and "refused by rank 0" in out, out
    finally:
        kill_tree(bad)
    assert new_children(before, WAIT_S) == set()
