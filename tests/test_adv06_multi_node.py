"""Advanced lesson 06 across machines, played on one (lesson 17's launch path): node 1 is
`python -m advanced.adv06_pipeline_parallel.node`, its own process tree. PP=2 over the two gives
one process's tokens, and so does the same under `torchrun --nnodes 2`; a node that cuts the model
differently is refused at the rendezvous; a node killed mid-run is named in seconds."""
from __future__ import annotations

import json
import time

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.launch import NodeLaunch
from advanced.adv06_pipeline_parallel.engine import PPEngine
from tests.processes import free_port, gone, kill_tree, start_node, torchrun_tokens
from tests.test_adv06_pipeline_parallel import _generate_until_failure, _prompts


# Two 'machines' on loopback, torchrun included: about a minute for the four files; CI runs them (make test-slow).
pytestmark = pytest.mark.slow

CONFIG = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=1 << 20)
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _node1(folder, port: int, *extra: str):
    return start_node("advanced.adv06_pipeline_parallel.node", folder, port, "--pipeline-parallel-size", "2", *extra)


def _launch(port: int) -> NodeLaunch:
    return NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)


@pytest.fixture(scope="module")
def one_process(tiny4):
    """(prompts, lesson 16's fast-path tokens for them in one process, fp32)."""
    prompts = _prompts(512, (20, 17, 3))
    engine = build_engine(load_model(tiny4, torch.float32), CONFIG, use_graph=False)
    return prompts, [s.output_token_ids for s in engine.generate(prompts, SP)]


def test_two_nodes_give_the_tokens_of_one_process(tiny4, one_process, capsys, no_leftovers):
    prompts, ref = one_process
    port = free_port()
    node1 = _node1(tiny4, port)
    try:
        with PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
                      launch=_launch(port)) as engine:
            assert engine.workers == []                   # stage 1 lives on "node 1"
            assert [s.output_token_ids for s in engine.generate(prompts, SP)] == ref
            assert len(engine.collect_timelines()) == 2   # its timeline comes over the control socket
        assert "rank  node" in capsys.readouterr().out    # the placement table at start-up
        out = gone(node1)
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)


def test_a_node_with_another_layer_split_is_refused(tiny4, no_leftovers):
    port = free_port()
    bad = _node1(tiny4, port, "--partition", "1,3")                # node 0 splits 2,2
    try:
        with pytest.raises(RendezvousError, match="pp_layers=2,2.*pp_layers=1,3"):
            PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, dtype=torch.float32, launch=_launch(port))
        out = gone(bad)
        assert bad.returncode == 2 and "refused by rank 0" in out, out
    finally:
        kill_tree(bad)


def test_a_node_killed_mid_run_names_the_lost_rank(tiny4, no_leftovers):
    port = free_port()
    node1 = _node1(tiny4, port)
    try:
        engine = PPEngine(tiny4, CONFIG, pipeline_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
                          launch=_launch(port))
        engine.generate(_prompts(512, (5,)), SamplingParams(max_tokens=5, ignore_eos=True))    # healthy first
        kill_tree(node1)                                          # the whole machine goes
        t0 = time.monotonic()
        error = _generate_until_failure(engine)
        assert time.monotonic() - t0 < 10
        assert "rank 1 (node 1): connection lost" in str(error), error
    finally:
        kill_tree(node1)


TORCHRUN_SCRIPT = """
import json, sys, torch
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from advanced.adv06_pipeline_parallel.engine import PPEngine
from advanced.adv06_pipeline_parallel.node import run_torchrun_stage
folder = sys.argv[1]
run_torchrun_stage(folder, 2, torch.float32)               # rank 1: be stage 1, then exit here
config = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=1 << 20)
with PPEngine(folder, config, pipeline_parallel_size=2, dtype=torch.float32, threads_per_rank=1) as engine:
    outs = engine.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
print("TOKENS", json.dumps([s.output_token_ids for s in outs]))
"""


def test_torchrun_two_nodes_on_loopback(tiny4, one_process, tmp_path, no_leftovers):
    """`torchrun --nnodes 2`, one process per node: rank 0 builds the PPEngine from torchrun's
    environment, rank 1 turns into stage 1 in place."""
    prompts, ref = one_process
    assert torchrun_tokens(tmp_path, TORCHRUN_SCRIPT, str(tiny4), json.dumps(prompts)) == ref
