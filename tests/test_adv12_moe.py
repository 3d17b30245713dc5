"""Advanced lesson 12: a Qwen3-MoE model held to transformers' Qwen3MoeForCausalLM on tiny random
checkpoints (logits, and greedy tokens through the paged, batched engine); the grouped expert
matmuls held to a per-token loop; the strict loader; EPLB placements valid for any load (a
property test) and better balanced on skewed load; expert parallel over 2 processes giving one
process's tokens, and a killed rank a clear error with nothing left running."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.workers import WorkerFailed
from advanced.adv12_moe.config import MoEConfig
from advanced.adv12_moe.engine import build_moe_engine
from advanced.adv12_moe.ep_engine import EPEngine
from advanced.adv12_moe.eplb import balancedness, placement_from_map, rebalance_experts, static_placement
from advanced.adv12_moe.model import load_moe_model, moe_layers, routing_counts
from advanced.adv12_moe.tiny import build_tiny_moe

SPARSE_1 = dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)     # layers 0 and 2 sparse
SPARSE_2 = dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)     # layer 1 sparse


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"), **SPARSE_1)


def _prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


CFG = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, kv_cache_bytes=2**20)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# ---- the model against transformers -------------------------------------------------------------
@pytest.mark.parametrize("layout", [SPARSE_1, SPARSE_2], ids=["step1-mlp_only1-norm", "step2-nonorm"])
def test_logits_equal_hf_and_sparse_layers_as_transformers(tmp_path, layout):
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    folder = build_tiny_moe(tmp_path, **layout)
    hf = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_moe_model(folder, torch.float32)
    cfg = MoEConfig.from_pretrained(folder)
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    assert cfg.sparse_layers == hf_sparse == [m.layer_idx for m in moe_layers(ours)]
    ids = torch.tensor(_prompts(cfg.vocab_size, (40,))[0])
    ref = hf(ids[None]).logits[0]
    got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_grouped_experts_equal_a_per_token_loop(tiny_moe):
    """The sort + one matmul per expert gives what each token's k experts give one by one."""
    moe = moe_layers(load_moe_model(tiny_moe, torch.float32))[0]
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.router(x)
    ref = torch.stack([sum(w * moe.expert(int(e))(x[t:t + 1])[0] for w, e in zip(weights[t], ids[t]))
                       for t in range(len(x))])
    torch.testing.assert_close(moe(x), ref, atol=1e-6, rtol=1e-5)
    assert int(moe.counts.sum()) == 23 * moe.top_k                # every (token, slot) pair counted


def test_loader_is_strict_and_reads_only_held_experts(tmp_path, tiny_moe):
    part = load_moe_model(tiny_moe, torch.float32, held=lambda layer: [1, 5])
    assert all(sorted(m.experts) == ["1", "5"] for m in moe_layers(part))
    tensors = load_file(str(tiny_moe / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_moe / "config.json").read_text())
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        load_moe_model(bad, torch.float32)
    load_moe_model(bad, torch.float32, held=lambda layer: [0, 1])      # a rank without expert 3 does not need it


def test_engine_tokens_equal_hf_generate(tiny_moe, one_thread):
    """Lesson 16's engine (paged KV, 4 sequences batched, prompts chunked by 16 tokens) on the MoE model."""
    from transformers import Qwen3MoeForCausalLM
    hf = Qwen3MoeForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    prompts = _prompts(256, (5, 30, 17, 9, 2))
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
           for p in prompts]
    engine = build_moe_engine(load_moe_model(tiny_moe, torch.float32), CFG)
    assert [s.output_token_ids for s in engine.generate(prompts, GREEDY)] == ref
    counts = routing_counts(engine.model)
    assert counts.shape == (2, 8) and int(counts.sum()) > 0


# ---- EPLB ---------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_rebalance_experts_maps_are_valid(data):
    ranks = data.draw(st.integers(1, 6))
    experts = data.draw(st.integers(1, 24))
    per_rank = data.draw(st.integers(-(-experts // ranks), -(-experts // ranks) + 4))
    load = torch.tensor(data.draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts)))
    p = rebalance_experts(load, per_rank * ranks, ranks)
    p2l, l2p, counts = p.physical_to_logical, p.logical_to_physical, p.replica_counts
    assert len(p2l) == per_rank * ranks and p.slots_per_rank == per_rank
    assert (counts >= 1).all() and int(counts.sum()) == per_rank * ranks          # every expert placed
    assert torch.equal(torch.bincount(p2l, minlength=experts), counts)
    for e in range(experts):                                                       # the maps agree
        slots = l2p[e][l2p[e] >= 0]
        assert len(slots) == counts[e] and (p2l[slots] == e).all()
        assert (l2p[e][counts[e]:] == -1).all()
    assert torch.equal(torch.bincount(p.rank_of(torch.arange(len(p2l))), minlength=ranks),
                       torch.full((ranks,), per_rank))
    assert abs(float(p.rank_loads(load).sum()) - float(load.sum())) < 1e-6 * (1 + float(load.sum()))
    ids = torch.randint(0, experts, (data.draw(st.integers(0, 40)), min(2, experts)))
    chosen = p.choose_replicas(ids, start=data.draw(st.integers(0, 5)))
    assert (p2l[chosen] == ids).all()                               # a replica runs the expert chosen
    for e in range(experts):                                        # and they share its pairs evenly
        per_replica = [int((chosen == slot).sum()) for slot in l2p[e][:counts[e]]]
        assert max(per_replica) - min(per_replica) <= 1


def test_rebalance_replicates_the_hot_expert_and_balances():
    load = torch.tensor([800, 100, 50, 50, 100, 100, 50, 50])
    before = static_placement(8, 2).rank_loads(load)
    p = rebalance_experts(load, 12, 2)
    assert int(p.replica_counts[0]) == 5                # 800 / 5 = 160 per replica: still the hottest share
    assert balancedness(before) == pytest.approx(650 / 1000)       # ranks: 800+100+50+50, 100+100+50+50
    assert balancedness(p.rank_loads(load)) > 0.95 > balancedness(before)


@pytest.mark.parametrize("call, message", [
    (lambda: rebalance_experts(torch.ones(8), 7, 1), "every expert needs a slot"),
    (lambda: rebalance_experts(torch.ones(8), 9, 2), "multiple of num_ranks"),
    (lambda: rebalance_experts(-torch.ones(4), 4, 2), "non-negative"),
    (lambda: static_placement(6, 4), "do not split evenly"),
    (lambda: placement_from_map([0, 1, 1, 2], 4, 2), r"experts \[3\] have no physical slot"),
])
def test_bad_placements_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- expert parallel ----------------------------------------------------------------------------
def test_ep2_with_replicated_experts_equals_one_process(tiny_moe, no_leftovers):
    """EP=2 over gloo (fp32), a skewed router (its bias sent to every rank), an EPLB placement with
    the hot experts replicated, against EP=1 (the single-process engine)."""
    prompts = _prompts(256, (5, 30, 17, 9, 1))
    bias = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    with EPEngine(tiny_moe, CFG, expert_parallel_size=1, dtype=torch.float32, router_bias=bias) as one:
        ref = [s.output_token_ids for s in one.generate(prompts, GREEDY)]
        counts = routing_counts(one.model)
    placements = {layer: rebalance_experts(counts[i], 12, 2) for i, layer in enumerate([0, 2])}
    assert any(int(p.replica_counts.max()) > 1 for p in placements.values())
    with EPEngine(tiny_moe, CFG, expert_parallel_size=2, placements=placements, dtype=torch.float32,
                  router_bias=bias, timeout_s=30) as engine:
        assert [s.output_token_ids for s in engine.generate(prompts, GREEDY)] == ref
        assert all(sorted(m.experts) == [str(e) for e in placements[m.layer_idx].held_by(0)]
                   for m in moe_layers(engine.model))                   # rank 0 holds only its experts
    assert engine.closed and not any(w.is_alive() for w in engine.workers)


@pytest.mark.slow
def test_killed_rank_is_a_clear_error_within_seconds(tiny_moe, no_leftovers):
    with EPEngine(tiny_moe, CFG, expert_parallel_size=2, dtype=torch.float32, timeout_s=30) as engine:
        engine.generate(_prompts(256, (5, 9)), SamplingParams(max_tokens=3, ignore_eos=True))     # healthy first
        for p in _prompts(256, (6, 7, 8), seed=2):
            engine.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
        killer = threading.Timer(0.3, os.kill, (engine.workers[0].pid, signal.SIGKILL))
        killer.start()
        t0 = time.perf_counter()
        with pytest.raises(WorkerFailed) as info:
            for _ in range(10_000):
                engine.step()
        killer.join()
        assert time.perf_counter() - t0 < 10
        assert "rank 1: process ended (killed by signal 9)" in str(info.value)
    assert engine.closed
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_bad_engine_arguments_fail_before_any_process(tiny_moe, no_leftovers):
    with pytest.raises(ValueError, match="sparse layers are"):
        EPEngine(tiny_moe, CFG, expert_parallel_size=2, placements={0: static_placement(8, 2)})
    with pytest.raises(ValueError, match="for 4 ranks"):
        EPEngine(tiny_moe, CFG, expert_parallel_size=2,
                 placements={0: static_placement(8, 4), 2: static_placement(8, 4)})


def _one_process(folder, prompts) -> list[list[int]]:
    engine = build_moe_engine(load_moe_model(folder, torch.float32), CFG)
    return [s.output_token_ids for s in engine.generate(prompts, GREEDY)]


@pytest.mark.slow
def test_two_nodes_on_loopback_give_the_tokens_of_one_process(tiny_moe, capsys, no_leftovers):
    """Rank 1 on "node 1": `python -m advanced.adv12_moe.node`, its own process tree, lesson 17's flags."""
    from step17_tensor_parallel.launch import NodeLaunch
    from tests.processes import free_port, gone, kill_tree, start_node
    prompts = _prompts(256, (12, 3, 20))
    ref = _one_process(tiny_moe, prompts)
    port = free_port()
    node1 = start_node("advanced.adv12_moe.node", tiny_moe, port, "--expert-parallel-size", "2")
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=30)
        with EPEngine(tiny_moe, CFG, expert_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
                      launch=launch) as engine:
            assert engine.workers == []                        # rank 1 lives on "node 1"
            assert [s.output_token_ids for s in engine.generate(prompts, GREEDY)] == ref
        assert "ranks per node: {0: [0], 1: [1]}" in capsys.readouterr().out
        out = gone(node1)
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)


TORCHRUN_SCRIPT = """
import json, sys, torch
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from advanced.adv12_moe.ep_engine import EPEngine
from advanced.adv12_moe.node import run_torchrun_ep_worker
folder = sys.argv[1]
run_torchrun_ep_worker(folder, 2, torch.float32)            # rank 1: be an expert-parallel worker, then exit here
config = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, kv_cache_bytes=2**20)
with EPEngine(folder, config, expert_parallel_size=2, dtype=torch.float32, threads_per_rank=1) as engine:
    outs = engine.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print("TOKENS", json.dumps([s.output_token_ids for s in outs]))
"""


@pytest.mark.slow
def test_torchrun_two_nodes_on_loopback(tiny_moe, tmp_path, no_leftovers):
    """`torchrun --nnodes 2 --nproc-per-node 1`: rank 0 builds the EPEngine from torchrun's environment."""
    import json
    from tests.processes import torchrun_tokens
    prompts = _prompts(256, (12, 3, 20))
    ref = _one_process(tiny_moe, prompts)
    assert torchrun_tokens(tmp_path, TORCHRUN_SCRIPT, str(tiny_moe), json.dumps(prompts)) == ref
