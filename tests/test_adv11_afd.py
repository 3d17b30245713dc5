"""Advanced lesson 11: attention/FFN disaggregation. The weight split (each side loads only its
tensors, the halves chain to the whole model); the micro-batch cut; the cost model on synthetic
numbers; the AFD engine giving the single-process tokens (fp32) with 1, 2 and 3 micro-batches and
with two FFN processes, and with the FFN process on another "node" (loopback); a killed, raising or hanging FFN process a clear error in seconds with
nothing left running."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from minivllm_support.timeline import Span, Timeline, chrome_trace, validate_trace
from step04_transformer.loader import load_model
from step04_transformer.model import SingleSequenceAttention
from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.control import RendezvousError
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.worker import model_bytes
from step17_tensor_parallel.workers import WorkerFailed
from advanced.adv11_afd.costmodel import (LayerCost, StepShape, balanced_ratio, fit_attention, fit_ffn, fit_hop,
                                          fit_nonnegative, layer_times, measured_loops, predict_loops, step_shapes)
from advanced.adv11_afd.engine import AFDEngine
from advanced.adv11_afd.ffn_worker import FAULT_ENV
from advanced.adv11_afd.microbatch import StepPlan, attention_rank, ffn_rank, owner, split_batch
from advanced.adv11_afd.runner import split_by_owner
from advanced.adv11_afd.split import attention_half, ffn_half, is_ffn_tensor, load_attention_side, load_ffn_side
from tests.processes import free_port, gone, kill_tree, start_node


def _prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- the weight split ---------------------------------------------------------------------------
def test_each_side_loads_only_its_tensors_and_the_halves_chain_to_the_model(tiny4):
    full = load_model(tiny4, torch.float32)
    attn_side, ffn_side = load_attention_side(tiny4, torch.float32), load_ffn_side(tiny4, torch.float32)
    a = {n for n, _ in attn_side.named_parameters()}
    f = {n for n, _ in ffn_side.named_parameters()}
    assert a and f and not a & f
    assert a | f == {n for n, _ in full.named_parameters()}                 # every weight on exactly one side
    assert all(".mlp." in n or ".post_attention_layernorm." in n for n in f)  # FFN: no attention, no embedding
    assert not any(".mlp." in n or ".post_attention_layernorm." in n for n in a)
    assert "model.embed_tokens.weight" in a and "model.norm.weight" in a
    assert model_bytes(attn_side) + model_bytes(ffn_side) == model_bytes(full)
    assert is_ffn_tensor("model.layers.3.mlp.down_proj.weight") and not is_ffn_tensor("model.layers.3.self_attn.o_proj.weight")
    ids, pos = torch.tensor([1, 5, 77, 300, 12]), torch.arange(5)
    cos, sin = attn_side.rotary(pos)
    x = attn_side.model.embed_tokens(ids)
    for la, lf in zip(attn_side.model.layers, ffn_side.model.layers):
        x = ffn_half(lf, attention_half(la, x, cos, sin, SingleSequenceAttention()))
    assert torch.equal(attn_side.compute_logits(attn_side.model.norm(x)), full.compute_logits(full(ids, pos)))
    with pytest.raises(RuntimeError, match="runs on the attention side"):    # a placeholder is never called
        ffn_side.model.layers[0].self_attn(x)


# ---- micro-batches ------------------------------------------------------------------------------
def _batch(tokens: list[int]) -> ScheduledBatch:
    b = ScheduledBatch()
    for n in tokens:
        b.add(Sequence(list(range(5, 5 + max(n, 1))), SamplingParams()), n)
    return b


@pytest.mark.parametrize("tokens, m, sizes", [
    ([1] * 8, 2, [4, 4]),                 # decodes: halves
    ([1] * 7, 2, [3, 4]),
    ([5, 1, 1, 1, 1], 2, [5, 4]),         # a prompt chunk on its own
    ([1, 1, 1, 1, 5], 2, [4, 5]),
    ([30, 1, 1], 2, [30, 2]),             # whole sequences only: as near as they allow
    ([1, 1], 3, [1, 1]),                  # fewer sequences than m: fewer micro-batches
    ([1, 1, 1, 1, 1, 1], 3, [2, 2, 2]),
    ([4], 1, [4]),
])
def test_split_batch_cuts_whole_sequences_in_order(tokens, m, sizes):
    batch = _batch(tokens)
    mbs = split_batch(batch, m)
    assert [mb.tokens for mb in mbs] == sizes and [mb.index for mb in mbs] == list(range(len(sizes)))
    assert [s for mb in mbs for s in mb.batch.seqs] == batch.seqs          # every sequence once, in order
    assert mbs[0].start == 0 and mbs[-1].end == sum(tokens)
    assert all(a.end == b.start for a, b in zip(mbs, mbs[1:]))             # contiguous rows
    assert all(mb.batch.total_tokens == mb.tokens for mb in mbs)


def test_split_batch_edge_cases_and_the_plan():
    assert split_batch(ScheduledBatch(), 2) == []
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        split_batch(_batch([1]), 0)
    seq = Sequence(list(range(10)), SamplingParams())
    seq.num_computed_tokens = 6
    b = ScheduledBatch()
    b.add(seq, 4)
    assert split_batch(b, 1)[0].kv_tokens == 10                             # context after this step
    assert [ffn_rank(i, 2) for i in range(4)] == [1, 2, 1, 2] and ffn_rank(1, 1) == 1
    plan = StepPlan(7, 30, [[5, 4]])
    assert StepPlan.from_bytes(plan.to_bytes()) == plan
    with pytest.raises(ValueError, match="does not describe"):
        StepPlan.from_bytes(plan.to_bytes()[:-8])
    two = StepPlan(8, 30, [[3], [2, 6]])                                    # 2:1: rank 0 one micro-batch, peer two
    assert StepPlan.from_bytes(two.to_bytes()) == two and two.num_micro_batches == 2
    assert two.senders(0, 1) == [(0, 3), (2, 2)] and two.senders(1, 1) == [(2, 6)]
    idle = StepPlan(9, 30, [[], [1]])                                       # rank 0 has nothing this step
    assert StepPlan.from_bytes(idle.to_bytes()) == idle and idle.senders(0, 1) == [(2, 1)]
    assert [attention_rank(a, 1) for a in range(3)] == [0, 2, 3] and [owner(k, 2) for k in range(4)] == [0, 1, 0, 1]


# ---- the cost model on synthetic numbers --------------------------------------------------------
def _synthetic(attn: LayerCost, ffn: LayerCost, steps: list[list[tuple[int, int]]], layers: int = 3,
               hop_ns: int = 0):
    """Timelines whose spans last exactly what the given costs say, laid out as m = 1 runs them:
    attention, then the exchange (hop_ns of transfers around the FFN's compute), then the next layer."""
    t, r0, r1 = 0, Timeline(0), Timeline(1)
    for k, mbs in enumerate(steps):
        for layer in range(layers):
            for i, (tok, kv) in enumerate(mbs):
                a, f = int(attn(tok, kv) * 1e9), int(ffn(tok) * 1e9)
                r0.spans.append(Span("attn", "compute", t, t + a, dict(step=k, layer=layer, micro_batch=i, tokens=tok,
                                                                    kv_tokens=kv)))
                r1.spans.append(Span("ffn", "compute", t + a + hop_ns // 2, t + a + hop_ns // 2 + f,
                                     dict(step=k, layer=layer, micro_batch=i, tokens=tok)))
                r0.spans.append(Span("wait FFN", "recv", t + a, t + a + f + hop_ns,
                                     dict(step=k, layer=layer, micro_batch=i, round_trip_us=(f + hop_ns) / 1e3)))
                t += a + f + hop_ns
    return [r0, r1]


def test_cost_model_recovers_known_costs_and_predicts_the_balance():
    attn, ffn = LayerCost(20e-6, 5e-6, 10e-9), LayerCost(50e-6, 15e-6)
    steps = [[(40, 40)], [(8, 400)], [(8, 1200)], [(16, 3000)], [(3, 90)], [(25, 700)]]
    tls = _synthetic(attn, ffn, steps, hop_ns=300_000)
    fa, ff, hop = fit_attention(tls[0]), fit_ffn(tls), fit_hop(tls)
    assert hop == pytest.approx(300e-6, rel=1e-3)
    for got, want in ((fa, attn), (ff, ffn)):
        assert got.fixed_s == pytest.approx(want.fixed_s, rel=1e-3, abs=1e-8)
        assert got.per_token_s == pytest.approx(want.per_token_s, rel=1e-3)
        assert got.per_kv_token_s == pytest.approx(want.per_kv_token_s, rel=1e-3, abs=1e-12)
    shapes = step_shapes(tls[0])
    assert [s.micro_batches for s in shapes] == steps and all(s.layers == 3 for s in shapes)
    pred, meas = predict_loops(shapes, fa, ff, hop, 1), measured_loops(tls)
    assert pred.seconds == pytest.approx(meas.seconds, rel=1e-3)           # m = 1: each side waits for the other
    assert pred.attention_busy == pytest.approx(meas.attention_busy, rel=1e-3)
    assert pred.ffn_busy == pytest.approx(meas.ffn_busy, rel=1e-3)
    assert pred.attention_busy + pred.ffn_busy < 1                         # the exchanges: nobody computes
    # Balance: attention time / FFN time for the same tokens; it grows with the context read.
    assert balanced_ratio(attn, ffn, 16, 64) == pytest.approx(attn(16, 16 * 64) / ffn(16))
    assert balanced_ratio(attn, ffn, 16, 4096) > balanced_ratio(attn, ffn, 16, 64)


def test_ping_pong_hides_the_smaller_side_and_more_ffn_ranks_share_its_work():
    attn, ffn, hop = LayerCost(0.0, 1.0), LayerCost(0.0, 3.0), 0.5
    one = StepShape(0, 1, [(4, 0)])
    two = StepShape(0, 1, [(2, 0), (2, 0)])
    assert layer_times(one, attn, ffn, hop, 1) == (4 + 12 + 0.5, 4, 12)          # m = 1: in series
    assert layer_times(two, attn, ffn, hop, 1) == (12, 4, 12)                    # m = 2: the FFN sets the pace
    assert layer_times(two, attn, ffn, hop, 2) == (2 + 6 + 0.5, 4, 6)            # 1:2: one chain sets it
    assert fit_nonnegative([[1, 0], [1, 1], [1, 2]], [3, 2, 1]) == pytest.approx([2, 0])  # a slope < 0 dropped


# ---- the engine: the tokens of one process ------------------------------------------------------
def _config() -> PagedSchedulerConfig:
    return PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, kv_cache_bytes=2**20)


def test_afd_equals_single_process_with_micro_batches_and_its_ffn_killed(tiny4, no_leftovers):
    """One FFN process; m = 1, 2, 3 with chunked prefill (16-token budget) give the single-process
    tokens; the timeline is valid; then the FFN process is killed mid-run: a clear error within
    seconds, the engine closed, nothing left running."""
    prompts = _prompts(512, (3, 40, 17, 64, 9, 30))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [s.output_token_ids for s in build_engine(load_model(tiny4, torch.float32), _config(), use_graph=False)
           .generate(prompts, sp)]
    with AFDEngine(tiny4, _config(), dtype=torch.float32, timeout_s=20) as engine:
        for m in (1, 2, 3):
            engine.set_micro_batches(m)
            engine.traffic.reset()
            assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref, m
            t = engine.traffic
            assert t.to_ffn == t.from_ffn == t.layer_tokens * 64 * 4              # hidden 64, fp32, each way
        tls = engine.collect_timelines()
        assert validate_trace(chrome_trace(tls)) == [] and len(tls) == 2
        ffn_spans = [s for s in tls[1].spans if s.cat == "compute"]
        assert {s.args["micro_batch"] for s in ffn_spans} == {0, 1, 2} and {s.args["layer"] for s in ffn_spans} == set(range(4))
        killer = threading.Timer(0.3, os.kill, (engine.workers[0].pid, signal.SIGKILL))
        for prompt in _prompts(512, (20, 30, 40)):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        killer.start()
        t0 = time.perf_counter()
        with pytest.raises(WorkerFailed) as info:
            for _ in range(100_000):                    # steps go on (idle ones too) until the loss is seen
                engine.step()
        killer.join()
        assert time.perf_counter() - t0 < 10
        assert "rank 1: process ended (killed by signal 9)" in str(info.value)
        assert engine.closed and not any(w.is_alive() for w in engine.workers)
        with pytest.raises(RuntimeError, match="closed"):
            engine.step()


def test_bad_arguments_are_refused_before_any_process(tiny4, no_leftovers):
    with pytest.raises(ValueError, match="num_ffn must be >= 1"):
        AFDEngine(tiny4, num_ffn=0)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        AFDEngine(tiny4, num_micro_batches=0)
    with pytest.raises(TypeError, match="PagedSchedulerConfig"):
        AFDEngine(tiny4, object())
    with pytest.raises(ValueError, match="one FFN rank"):
        AFDEngine(tiny4, num_attention=2, num_ffn=2)
    with pytest.raises(ValueError, match="one machine only"):
        AFDEngine(tiny4, num_attention=2, launch=NodeLaunch(nnodes=2, node_rank=0, master_port=free_port()))


# ---- slow: the embedded model, two FFN processes, the other faults -----------------------------
@pytest.mark.slow
def test_afd_on_smollm2_two_ffn_processes_one_and_two_micro_batches(smol_dir, smol_fp32, smol_prompts, no_leftovers):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20, 16, 18, 10)]
    cfg = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=16, kv_cache_bytes=64 * 2**20)
    ref = [s.output_token_ids for s in build_engine(smol_fp32, cfg, use_graph=False).generate(smol_prompts, params)]
    assert any(len(r) < sp.max_tokens for r, sp in zip(ref, params))              # some stop at EOS
    with AFDEngine(smol_dir, cfg, num_ffn=2, dtype=torch.float32) as engine:
        mem = [r["weight_bytes"] for r in engine.rank_memory]
        assert mem[0] + mem[1] == model_bytes(smol_fp32) and mem[1] == mem[2]      # FFN ranks: replicas
        for m, served in ((2, [{0}, {1}]), (1, [{0}, set()])):                    # micro-batch i -> 1 + i % 2
            engine.set_micro_batches(m)
            assert [s.output_token_ids for s in engine.generate(smol_prompts, params)] == ref, m
            tls = engine.collect_timelines()
            assert [{s.args["micro_batch"] for s in tl.spans if s.cat == "compute"} for tl in tls[1:]] == served
            assert validate_trace(chrome_trace(tls)) == []


@pytest.mark.slow
@pytest.mark.parametrize("fault, expect", [("raise@3", "injected fault"), ("exit@3", "process ended (exit code 3)"),
                                           ("hang@2", "Timed out")])
def test_ffn_that_raises_exits_or_hangs(tiny4, monkeypatch, fault, expect, no_leftovers):
    monkeypatch.setenv(FAULT_ENV, fault)               # inherited by the spawned FFN process
    with AFDEngine(tiny4, _config(), dtype=torch.float32, timeout_s=2) as engine:
        for prompt in _prompts(512, (20, 30)):
            engine.add_request(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
        t0 = time.perf_counter()
        with pytest.raises(WorkerFailed) as info:
            while engine.has_unfinished():
                engine.step()
        assert time.perf_counter() - t0 < 10
        assert expect in str(info.value)
        assert engine.closed and not any(w.is_alive() for w in engine.workers)


@pytest.mark.slow
def test_the_ffn_side_on_another_node(tiny4, no_leftovers):
    """Two 'machines' on loopback (lesson 17's launch path): node 1 is `python -m advanced.adv11_afd.node`,
    its own process tree, holding the FFN rank; the tokens are one process's, and node 1 exits 0 on close."""
    prompts = _prompts(512, (20, 17, 3))
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = [s.output_token_ids for s in build_engine(load_model(tiny4, torch.float32), _config(), use_graph=False)
           .generate(prompts, sp)]
    port = free_port()
    node1 = start_node("advanced.adv11_afd.node", tiny4, port, "--num-ffn", "1")
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)
        with AFDEngine(tiny4, _config(), dtype=torch.float32, threads_per_rank=1, launch=launch) as engine:
            assert engine.workers == []                   # the FFN process lives on "node 1"
            assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
            assert len(engine.collect_timelines()) == 2   # its timeline comes over the control socket
        out = gone(node1)
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)


@pytest.mark.slow
def test_a_node_started_for_another_ratio_is_refused(tiny4, no_leftovers):
    port = free_port()
    bad = start_node("advanced.adv11_afd.node", tiny4, port, "--num-ffn", "3")     # node 0 runs 1:1
    try:
        launch = NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)
        with pytest.raises(RendezvousError, match="world: node 0 has 2, this node has 4"):
            AFDEngine(tiny4, _config(), dtype=torch.float32, launch=launch)
        out = gone(bad)
        assert bad.returncode == 2 and "refused by rank 0" in out, out
    finally:
        kill_tree(bad)
