"""Advanced lesson 08 across machines, played on one: node 1 is `python -m
advanced.adv08_data_parallel.node`, its own process tree, and its replica dials node 0's front end
through lesson 17's control channel. The two serve one engine's tokens, their steps on one aligned
timeline; when node 1 is killed only its requests fail and node 0 serves on; a node started with
other flags is refused, naming the field. Under `torchrun --nnodes 2` rank 0 is the front end and
rank 1 turns into the replica: one engine's tokens again; a world that does not fit is refused."""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
import torch

from advanced.adv08_data_parallel.frontend import DPFrontEnd
from advanced.adv08_data_parallel.node import run_torchrun_replica
from minivllm_support.timeline import chrome_trace, validate_trace
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.launch import NodeLaunch
from step18_benchmark.faults import EngineDead
from step19_real_model.engine import LogprobsEngine
from tests.processes import fake_torchrun_env, free_port, gone, kill_tree, new_children, our_children, start_node, torchrun_tokens
from tests.test_adv08_data_parallel import WAIT_S, _greedy, _run, _tokens


# Two 'machines' on loopback, torchrun included: about a minute for the four files; CI runs them (make test-slow).
pytestmark = pytest.mark.slow

def _node1(folder, port: int, *extra: str):
    return start_node("advanced.adv08_data_parallel.node", folder, port, "--data-parallel-size", "2",
                      "--kv-mib", "16", *extra)


def _two_nodes(folder, port: int, **kw) -> DPFrontEnd:
    launch = NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)
    return DPFrontEnd(folder, 2, "round_robin", dtype=torch.float32, kv_cache_bytes=16 * 2**20, launch=launch, **kw)


PROMPTS = [[5, 9, 33, 7] * 5, list(range(40, 57)), [3, 4], [11] * 9]


def _one_engine(folder) -> list[list[int]]:
    """PROMPTS' 6 greedy tokens from one engine in this process: the replicas' engine, on one thread."""
    engine = LogprobsEngine(folder, PagedSchedulerConfig(kv_cache_bytes=16 * 2**20), dtype=torch.float32,
                            threads_per_rank=1, use_graph=False)
    try:
        return [s.output_token_ids for s in engine.generate(PROMPTS, _greedy(6))]
    finally:
        engine.close()


def test_two_nodes_serve_one_engines_tokens_then_node1_dies_and_only_its_requests_fail(tiny_qwen3_dir):
    before = {p.pid for p in our_children()}
    expected = _one_engine(tiny_qwen3_dir)
    port = free_port()
    node1 = _node1(tiny_qwen3_dir, port)
    try:
        with _two_nodes(tiny_qwen3_dir, port, trace=True) as front:
            rep0, rep1 = front._hub.replicas
            assert rep0.proc is not None and rep1.proc is None and rep1.node == 1   # replica 1: node 1's

            async def all_at_once():
                return await asyncio.gather(*(_tokens(front, p, 6) for p in PROMPTS))
            t0 = time.perf_counter_ns()
            assert _run(all_at_once()) == expected and front.routed() == [2, 2]
            t1 = time.perf_counter_ns()
            # Node 1's replica traces too (the setting reaches replicas node 0 did not start), and each
            # timeline carries the offset measured at its start. On one machine there is one clock:
            # the raw spans lie inside the run as node 0's clock saw it, and the true offset is 0, so
            # the estimate's error is the offset itself (measure_offset takes the midpoint of the
            # shortest round trip: good to half of it). Aligned spans may stray outside [t0, t1] by
            # that much and no more; demanding more would test the estimate beyond its precision.
            tls = front.timelines()
            assert [t.rank for t in tls] == [0, 1] and all(t.spans for t in tls)
            assert [t.offset_ns for t in tls] == [rep0.offset_ns, rep1.offset_ns]
            assert all(abs(t.offset_ns) < 50_000_000 for t in tls), [t.offset_ns for t in tls]
            assert all(t0 <= s.start_ns and s.end_ns <= t1 for t in tls for s in t.spans)
            for t in tls:
                err = abs(t.offset_ns)
                assert all(t0 - err <= s.start_ns and s.end_ns <= t1 + err for s in t.aligned()), t.offset_ns
            assert not validate_trace(chrome_trace(tls))

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


TORCHRUN_SCRIPT = """
import asyncio, json, sys, torch
from advanced.adv08_data_parallel.frontend import DPFrontEnd
from advanced.adv08_data_parallel.node import run_torchrun_replica
from minivllm_support.timeline import chrome_trace, validate_trace
from step19_real_model.params import SamplingParams
folder, prompts = sys.argv[1], json.loads(sys.argv[2])
run_torchrun_replica(folder, 1, torch.float32, kv_cache_bytes=16 << 20)   # rank 1: be replica 0, then exit here
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

async def tokens(front):
    async def one(prompt):
        return [e.token_id async for e in front.generate(prompt, params)]
    return await asyncio.gather(*(one(p) for p in prompts))

with DPFrontEnd(folder, 1, "round_robin", dtype=torch.float32, kv_cache_bytes=16 << 20, trace=True) as front:
    (rep,) = front._hub.replicas
    assert rep.proc is None and rep.node == 1, (rep.proc, rep.node)       # torchrun's rank 1, on node 1
    out = asyncio.run(tokens(front))
    (tl,) = front.timelines()
    assert tl.spans and tl.offset_ns == rep.offset_ns and abs(tl.offset_ns) < 50_000_000, tl.offset_ns
    assert not validate_trace(chrome_trace([tl]))
print("TOKENS", json.dumps(out))
"""


def test_torchrun_two_nodes_on_loopback_front_end_and_one_replica(tiny_qwen3_dir, tmp_path, no_leftovers):
    """`torchrun --nnodes 2 --nproc-per-node 1`: world 2 = 1 replica + the front end. Rank 0 builds the
    DPFrontEnd from torchrun's environment (it spawns nobody), rank 1 turns into replica 0 in place;
    its tokens are one engine's, its steps traced with its clock offset measured."""
    got = torchrun_tokens(tmp_path, TORCHRUN_SCRIPT, str(tiny_qwen3_dir), json.dumps(PROMPTS))
    assert got == _one_engine(tiny_qwen3_dir)


def test_a_torchrun_world_that_does_not_fit_is_refused_on_every_rank(tiny_qwen3_dir, monkeypatch, capsys):
    """world = data-parallel size + 1, checked before anyone joins torchrun's store: no waiting out
    the rendezvous timeout, and the message names both numbers. Outside torchrun: a no-op."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    run_torchrun_replica(tiny_qwen3_dir, 1, torch.float32)                  # not under torchrun: returns
    before = len(our_children())
    fake_torchrun_env(monkeypatch, 0, 3)
    wrong = "torchrun started 3 processes (WORLD_SIZE = --nnodes x --nproc-per-node), but data-parallel size 1"
    with pytest.raises(ValueError, match=re.escape(wrong) + ".* needs 2"):
        DPFrontEnd(tiny_qwen3_dir, 1, "round_robin")
    fake_torchrun_env(monkeypatch, 1, 3)
    with pytest.raises(SystemExit) as exited:
        run_torchrun_replica(tiny_qwen3_dir, 1, torch.float32)
    assert exited.value.code == 2 and wrong in capsys.readouterr().err
    with pytest.raises(ValueError, match="torchrun rank 1 is a replica, not the front end"):
        DPFrontEnd(tiny_qwen3_dir, 2, "round_robin")
    assert len(our_children()) == before
