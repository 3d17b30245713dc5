"""Lesson 17 across machines, played on one: two "nodes" that share nothing but the rendezvous
address. Node 0 is this test process (the engine); node 1 is `python -m step17_tensor_parallel.node`,
its own process tree. Tokens equal TP=1 (fp32); a node that never joins, one started with other
flags, and one killed mid-run all end in seconds with a message naming it, and nothing is left."""
from __future__ import annotations

import json
import time

import psutil
import pytest
import torch

from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.engine import TPEngine, WorkerFailed
from step17_tensor_parallel.launch import NodeLaunch, placement, placement_table
from step17_tensor_parallel.node import run_torchrun_worker
from tests.processes import (fake_torchrun_env, free_port, gone, kill_tree, new_children, start_node, still_running,
                             torchrun_tokens)


# Two 'machines' on loopback, torchrun included: about a minute for the four files; CI runs them (make test-slow).
pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 33, 7] * 5, list(range(40, 57)), [3, 4]]
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CONFIG = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=1 << 20)


def _node1(folder, port: int, *extra: str):
    return start_node("step17_tensor_parallel.node", folder, port, "--tensor-parallel-size", "2", *extra)


def _no_children():
    assert new_children(set()) == set()        # nothing of ours left (the resource tracker aside)


@pytest.fixture(scope="module")
def tp1_tokens(tiny_qwen3_dir):
    with TPEngine(tiny_qwen3_dir, CONFIG, dtype=torch.float32, use_graph=False) as engine:
        return [s.output_token_ids for s in engine.generate(PROMPTS, SP)]


def test_placement_keeps_tp_inside_a_node_and_pp_across():
    places = placement(tp=2, pp=2, nnodes=2)
    assert [(p.rank, p.node, p.pp_stage, p.tp_rank) for p in places] == [(0, 0, 0, 0), (1, 0, 0, 1),
                                                                          (2, 1, 1, 0), (3, 1, 1, 1)]
    assert "straddle" not in placement_table(places) and "spans nodes" not in placement_table(places)
    assert "spans nodes" in placement_table(placement(tp=2, pp=1, nnodes=2))
    with pytest.raises(ValueError, match="do not split evenly"):
        placement(tp=2, pp=1, nnodes=3)


def test_launch_flags_are_checked_and_torchrun_env_is_read():
    with pytest.raises(ValueError, match="--node-rank"):
        NodeLaunch(nnodes=2, node_rank=2, master_port=1234)
    with pytest.raises(ValueError, match="--master-port"):
        NodeLaunch(nnodes=2, node_rank=1)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    launch = NodeLaunch.from_env(env)
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port, launch.torchrun) == \
        (2, 1, "10.0.0.1", 29500, True)
    assert launch.local_ranks(4) == [2, 3] and NodeLaunch.from_env({}) is None


def test_two_nodes_give_the_tokens_of_one_process(tiny_qwen3_dir, tp1_tokens, capsys):
    port = free_port()
    node1 = _node1(tiny_qwen3_dir, port)
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)
        with TPEngine(tiny_qwen3_dir, CONFIG, tensor_parallel_size=2, dtype=torch.float32, launch=launch,
                      threads_per_rank=1) as engine:
            assert engine.workers == [] and engine.all_reduce == "gloo"     # rank 1 lives on "node 1"
            assert [s.output_token_ids for s in engine.generate(PROMPTS, SP)] == tp1_tokens
        assert "rank  node" in capsys.readouterr().out          # the placement table at start-up
        out = gone(node1)
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)
    _no_children()


def test_a_node_that_never_joins_is_named(tiny_qwen3_dir):
    launch = NodeLaunch(nnodes=2, node_rank=0, master_port=free_port(), rendezvous_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"node rank\(s\) \[1\] never joined"):
        TPEngine(tiny_qwen3_dir, CONFIG, tensor_parallel_size=2, dtype=torch.float32, launch=launch)
    assert time.monotonic() - t0 < 10
    _no_children()


def test_a_node_with_other_flags_is_refused_naming_the_field(tiny_qwen3_dir):
    port = free_port()
    bad = _node1(tiny_qwen3_dir, port, "--dtype", "bf16")           # node 0 runs fp32 (last flag wins)
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_port=port, rendezvous_timeout_s=20)
        with pytest.raises(RendezvousError, match="dtype: node 0 has 'torch.float32', this node has 'torch.bfloat16'"):
            TPEngine(tiny_qwen3_dir, CONFIG, tensor_parallel_size=2, dtype=torch.float32, launch=launch)
        out = gone(bad)
        assert bad.returncode == 2 and "refused by rank 0" in out and "dtype" in out, out
    finally:
        kill_tree(bad)
    _no_children()


@pytest.mark.parametrize("what", ["the machine", "the launcher alone"])
def test_a_node_killed_mid_run_ends_the_engine_in_seconds(tiny_qwen3_dir, what):
    """the machine: node 1's whole process tree goes. the launcher alone: SIGKILL to node 1's
    `python -m step17_tensor_parallel.node` only, as a scheduler ending a job would; its worker
    must go with it (lifeline.py), or rank 0 would go on as if nothing had happened."""
    port = free_port()
    node1 = _node1(tiny_qwen3_dir, port)
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_port=port, rendezvous_timeout_s=20)
        with TPEngine(tiny_qwen3_dir, CONFIG, tensor_parallel_size=2, dtype=torch.float32, launch=launch,
                      threads_per_rank=1) as engine:
            engine.generate(PROMPTS[:1], SP)                           # healthy first
            workers = psutil.Process(node1.pid).children(recursive=True)
            assert workers, "node 1 started no worker"
            if what == "the machine":
                kill_tree(node1)
            else:
                node1.kill()
                alive = still_running(workers, 10)
                assert not alive, f"node 1's worker outlived its launcher: {[p.pid for p in alive]}"
            for p in PROMPTS:
                engine.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
            t0 = time.monotonic()
            with pytest.raises(WorkerFailed, match=r"rank 1 \(node 1\): connection lost"):
                for _ in range(10_000):
                    engine.step()
            assert time.monotonic() - t0 < 10 and engine.closed
    finally:
        kill_tree(node1)
    _no_children()


TORCHRUN_SCRIPT = """
import json, sys, torch
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.engine import TPEngine
from step17_tensor_parallel.node import run_torchrun_worker
folder = sys.argv[1]
run_torchrun_worker(folder, 2, torch.float32)            # rank 1: serve, then exit here
config = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=1 << 20)
with TPEngine(folder, config, tensor_parallel_size=2, dtype=torch.float32, threads_per_rank=1) as engine:
    outs = engine.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
print("TOKENS", json.dumps([s.output_token_ids for s in outs]))
"""


def test_torchrun_two_nodes_on_loopback(tiny_qwen3_dir, tp1_tokens, tmp_path):
    assert torchrun_tokens(tmp_path, TORCHRUN_SCRIPT, str(tiny_qwen3_dir), json.dumps(PROMPTS)) == tp1_tokens


def test_a_torchrun_world_other_than_tp_is_refused_on_every_rank(tiny_qwen3_dir, monkeypatch, no_leftovers):
    """Checked before a store is dialled: a wrong count would otherwise wait out the rendezvous."""
    refusal = r"torchrun started 3 processes .*, but tensor_parallel_size=2 needs 2"
    for rank in (0, 1):
        fake_torchrun_env(monkeypatch, rank, 3)
        with pytest.raises(ValueError, match=refusal):
            run_torchrun_worker(str(tiny_qwen3_dir), 2, torch.float32)
    fake_torchrun_env(monkeypatch, 0, 3)
    with pytest.raises(ValueError, match=refusal):
        TPEngine(tiny_qwen3_dir, CONFIG, tensor_parallel_size=2, dtype=torch.float32)
