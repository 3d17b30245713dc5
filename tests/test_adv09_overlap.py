"""Advanced lesson 09: two-batch overlap. The micro-batch cut (disjoint, covering, balanced by
tokens); a micro-batch's step attention equal to its rows of the whole step's; the hidden
fraction on a synthetic timeline; the overlap engine giving the single-process tokens (fp32)
through chunked prefill mixed with decodes, odd batch sizes and one-sequence steps, in both
schedules; a faulted worker a clear error in seconds with nothing left running."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from minivllm_support.timeline import Span, Timeline, chrome_trace, validate_trace
from step04_transformer.config import ModelConfig
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.backends import choose_backend
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.engine import TPEngine, WorkerFailed
from step17_tensor_parallel.metadata import MetadataAttention, StepMetadata
from step17_tensor_parallel.model import local_config
from step17_tensor_parallel.worker import FAULT_ENV
from advanced.adv09_overlap.engine import OverlapEngine
from advanced.adv09_overlap.measure import overlap_stats, rank_stats
from advanced.adv09_overlap.split import SubBatchAttention, balanced_cut, split_micro_batches


def _prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- the cut ------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_lens", [[1, 1], [1, 1, 1], [40, 1, 1, 1], [1, 1, 1, 40], [7, 3, 9, 1, 1],
                                    [16], [5, 5, 5, 5, 5, 5, 5], [100, 1], [3, 60, 2, 2, 1]])
def test_split_is_disjoint_covering_and_balanced(q_lens):
    mbs = split_micro_batches(q_lens)
    total = sum(q_lens)
    seqs = [i for mb in mbs for i in mb.seqs]
    rows = [r for mb in mbs for r in mb.rows]
    assert seqs == list(range(len(q_lens))) and rows == list(range(total))     # disjoint and covering, in order
    for mb in mbs:
        assert mb.num_tokens == sum(q_lens[i] for i in mb.seqs)                # rows are its sequences' tokens
    if len(q_lens) == 1:
        assert [mb.name for mb in mbs] == ["all"]                              # nothing to cut: one lane
        return
    assert [mb.name for mb in mbs] == ["A", "B"] and all(len(mb.seqs) for mb in mbs)
    best = min(abs(2 * sum(q_lens[:k]) - total) for k in range(1, len(q_lens)))   # every possible cut
    assert abs(mbs[0].num_tokens - mbs[1].num_tokens) == best


def test_split_random_batches_and_bad_input():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        q_lens = torch.randint(1, 50, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        k = balanced_cut(q_lens)
        gaps = [abs(2 * sum(q_lens[:j]) - sum(q_lens)) for j in range(1, len(q_lens))]
        assert gaps[k - 1] == min(gaps)
    assert split_micro_batches([3, 4, 5], overlap=False)[0].name == "all"
    assert balanced_cut([]) is None
    with pytest.raises(ValueError, match="at least one token"):
        balanced_cut([3, 0, 2])


def test_sub_batch_attention_equals_its_rows_of_the_step(tiny_qwen3_dir):
    """A prompt chunk, a decode and a chunk with prior context: attention of the whole step
    against the two micro-batches' attentions, each on a copy of the same pool."""
    cfg = local_config(ModelConfig.from_pretrained(tiny_qwen3_dir), 2)
    backend = choose_backend("torch")
    bs = 4
    pool = backend.pool_class(cfg, 12, bs, torch.float32)
    g = torch.Generator().manual_seed(0)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=g))                 # earlier tokens' K/V
    starts, q_lens, tables = [0, 6, 4], [5, 1, 3], [[0, 1], [2, 3], [4, 5]]
    cu = torch.tensor([0, 5, 6, 9])
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    seq_of_row = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    bt = torch.tensor(tables)
    slots = bt[seq_of_row, pos // bs] * bs + pos % bs
    meta = StepMetadata(torch.zeros(9, dtype=torch.long), pos, cu, torch.tensor(starts) + torch.tensor(q_lens), bt,
                        slots, torch.tensor([], dtype=torch.long))
    T, H, D = 9, cfg.num_heads, cfg.head_dim
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, cfg.num_kv_heads, cfg.num_kv_heads))
    copy = backend.pool_class(cfg, 12, bs, torch.float32)
    for a, b in zip((*copy.k, *copy.v), (*pool.k, *pool.v)):
        a.copy_(b)
    whole = MetadataAttention(pool, meta, backend)(0, q, k, v)
    step = MetadataAttention(copy, meta, backend)
    parts = []
    for mb in split_micro_batches(q_lens):
        r = slice(mb.rows.start, mb.rows.stop)
        parts.append(SubBatchAttention(step, mb)(0, q[r], k[r], v[r]))
    assert [mb.name for mb in split_micro_batches(q_lens)] == ["A", "B"]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)
    assert torch.equal(copy.k[0], pool.k[0]) and torch.equal(copy.v[0], pool.v[0])   # same K/V written


def test_partial_sum_hands_over_the_partial_and_refuses_a_bias():
    from torch import nn

    from step17_tensor_parallel.layers import RowParallelLinear
    from advanced.adv09_overlap.schedule import PartialSum, defer_reductions
    row = RowParallelLinear(8, 4, False, rank=0, world=2)
    model = nn.Sequential(row, nn.Identity())
    deferred = defer_reductions(model)
    assert type(deferred[0]) is PartialSum and deferred[0].linear is row.linear    # the same weights
    assert type(model[0]) is RowParallelLinear                                     # the original untouched
    x = torch.randn(3, 4)
    assert torch.equal(deferred(x), row.linear(x))                                 # no all-reduce inside
    with pytest.raises(ValueError, match="bias"):
        PartialSum(RowParallelLinear(8, 4, True, rank=0, world=2))


# ---- the hidden fraction --------------------------------------------------------------------------
def test_hidden_fraction_on_a_synthetic_timeline():
    """A's all-reduce 10-30 runs under B's compute 12-20 and A's own 20-25: only B's 8 count.
    B's all-reduce 20-40 runs under A's compute 20-25 and 30-35 (10 of 20). An unsplit step's
    all-reduce hides nothing. Total hidden 18 of 20 + 20 + 10 = 50."""
    def c(name, mb, a, b, cat="compute"):
        return Span(name, cat, a, b, {"mb": mb, "layer": 0} if cat == "compute" else {"mb": mb})
    compute = [c("A attn", "A", 0, 10), c("B attn", "B", 12, 20), c("A mlp", "A", 20, 25), c("A x", "A", 30, 35),
               c("wait B", "B", 35, 40, "wait"), c("all", "all", 50, 60)]
    reduces = [Span("ar A", "collective", 10, 30, {"mb": "A"}), Span("ar B", "collective", 20, 40, {"mb": "B"}),
               Span("ar all", "collective", 60, 70, {"mb": "all"})]
    st = overlap_stats(compute, reduces)
    assert (st.all_reduces, st.comm_ns, st.hidden_ns, st.wait_ns) == (3, 50, 18, 5)
    assert st.hidden_fraction == pytest.approx(18 / 50)
    assert len(st.layer_compute_ns) == 5
    rows = [Timeline(0, "c", compute), Timeline(1, "a", reduces[::2]), Timeline(2, "b", reduces[1:2]),
            Timeline(3, "c1", []), Timeline(4, "a1", [])]
    per_rank = rank_stats(rows)
    assert set(per_rank) == {0, 1} and per_rank[0].hidden_ns == 18 and per_rank[1].comm_ns == 0


def test_recorder_rows_and_bounded_memory(monkeypatch):
    from advanced.adv09_overlap import recorder
    monkeypatch.setattr(recorder, "MAX_SPANS_PER_ROW", 4)
    rec = recorder.StepRecorder(1)
    assert [tl.rank for tl in rec.rows] == [3, 4, 5]              # rank 1's three rows sort together
    for step in range(10):
        rec.begin_step(step, overlap=True)
        with rec.compute("A attn L0", "A", layer=0):
            pass
        rec.add_all_reduce("B", "B attn L0", 0, 1, 8, 0)
    assert len(rec.rows[0].spans) <= 5 and rec.rows[0].spans[-1].args["step"] == 9   # older half dropped
    assert rec.rows[2].spans and not rec.rows[1].spans            # B's sums on B's row
    assert rec.rows[0].spans[-1].args == {"mb": "A", "step": 9, "overlap": True, "layer": 0}


# ---- the engine ----------------------------------------------------------------------------------
def _config(**kw) -> PagedSchedulerConfig:
    return PagedSchedulerConfig(block_size=4, kv_cache_bytes=2**20, **kw)


def test_overlap_equals_plain_schedule_and_one_process_then_a_killed_worker(tiny_qwen3_dir, no_leftovers):
    """Chunked prefill (16-token budget) mixed with decodes, 3 sequences at a time (odd cuts), and
    a tail of steps with one sequence left (no cut); fp32. Both schedules in the same processes.
    Then the worker is killed mid-run: WorkerFailed within seconds, nothing left running."""
    prompts = _prompts(512, (3, 40, 17, 9, 30, 1))
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 4, 5, 7, 16)]
    cfg = _config(max_num_seqs=3, max_num_batched_tokens=16)
    ref = [s.output_token_ids for s in build_engine(load_model(tiny_qwen3_dir, torch.float32), cfg, use_graph=False)
           .generate(prompts, sp)]
    with OverlapEngine(tiny_qwen3_dir, cfg, tensor_parallel_size=2, dtype=torch.float32, timeout_s=30) as engine:
        assert engine.all_reduce == "gloo" and len(engine.workers) == 1
        assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
        split = engine.collect_timelines()
        engine.overlap = False
        assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
        plain = engine.collect_timelines()
        engine.overlap = True
        error = _generate_until_failure(engine, kill_after_s=0.3)
    assert "rank 1: process ended (killed by signal 9)" in str(error)
    assert validate_trace(chrome_trace(split)) == [] and len(split) == 6      # 3 rows per rank
    names = {s.args["mb"] for tl in split for s in tl.spans if s.cat == "collective"}
    assert names == {"A", "B", "all"}                 # split steps and one-sequence steps both ran
    assert {s.args["mb"] for tl in plain for s in tl.spans if s.cat == "collective"} == {"all"}
    for stats in rank_stats(split).values():
        assert stats.all_reduces > 0 and 0.0 <= stats.hidden_fraction <= 1.0
    assert all(st.hidden_ns == 0 for st in rank_stats(plain).values())


def _generate_until_failure(engine: OverlapEngine, kill_after_s: float | None = None) -> WorkerFailed:
    """Run long requests until the worker fails (killed after kill_after_s, or by its own fault)."""
    for p in _prompts(512, (20, 30, 40)):
        engine.add_request(p, SamplingParams(max_tokens=400, ignore_eos=True))
    if kill_after_s is not None:
        killer = threading.Timer(kill_after_s, os.kill, (engine.workers[0].pid, signal.SIGKILL))
        killer.start()
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed) as info:
        for _ in range(5000):
            engine.step()
    assert time.perf_counter() - t0 < 10 + (kill_after_s or 0)
    assert engine.closed and not any(w.is_alive() for w in engine.workers)
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    return info.value


def test_refusals_before_any_process(tiny_qwen3_dir, no_leftovers):
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 2"):
        OverlapEngine(tiny_qwen3_dir, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        OverlapEngine(tiny_qwen3_dir, tensor_parallel_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("fault, timeout_s", [("raise@3", 30.0), ("hang@2", 2.0)])
def test_faulted_worker_is_a_clear_error_in_seconds(tiny_qwen3_dir, monkeypatch, fault, timeout_s, no_leftovers):
    """Lesson 17's fault switch (inherited by the spawned worker): one that raises sends its
    traceback; one that stops answering trips the collective timeout."""
    monkeypatch.setenv(FAULT_ENV, fault)
    with OverlapEngine(tiny_qwen3_dir, _config(), tensor_parallel_size=2, dtype=torch.float32,
                       timeout_s=timeout_s) as engine:
        error = _generate_until_failure(engine)
    if fault.startswith("raise"):
        assert "injected fault" in str(error) and "rank 1 (two-batch overlap)" in str(error)


@pytest.mark.slow
def test_overlap_equals_lesson17_tp_engine_on_tiny(tiny_qwen3_dir, no_leftovers):
    """Lesson 17's TPEngine (gloo, its own schedule) and the overlap engine: the same tokens, fp32."""
    prompts = _prompts(512, (3, 40, 17, 9))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cfg = _config(max_num_seqs=3, max_num_batched_tokens=16)
    with TPEngine(tiny_qwen3_dir, cfg, tensor_parallel_size=2, dtype=torch.float32, all_reduce="gloo",
                  use_graph=False) as tp:
        ref = [s.output_token_ids for s in tp.generate(prompts, sp)]
    with OverlapEngine(tiny_qwen3_dir, cfg, tensor_parallel_size=2, dtype=torch.float32) as engine:
        assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref


@pytest.mark.slow
def test_overlap_equals_one_process_on_smollm2(smol_dir, smol_fp32, smol_prompts, no_leftovers):
    """The embedded model in fp32, TP=3 (its 9 heads split 3 ways), greedy, stopping at EOS."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 10, 8, 9, 5)]
    cfg = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=16, kv_cache_bytes=16 * 2**20)
    ref = [s.output_token_ids for s in build_engine(smol_fp32, cfg, use_graph=False).generate(smol_prompts, params)]
    with OverlapEngine(smol_dir, cfg, tensor_parallel_size=3, dtype=torch.float32) as engine:
        assert [s.output_token_ids for s in engine.generate(smol_prompts, params)] == ref


# ---- across machines (two "nodes" on loopback, lesson 17's launch) -------------------------------
@pytest.mark.slow
def test_two_nodes_give_the_tokens_of_one_process_and_a_lesson17_node_is_refused(tiny_qwen3_dir, no_leftovers):
    from step17_tensor_parallel.control import RendezvousError
    from step17_tensor_parallel.launch import NodeLaunch
    from tests.processes import free_port, gone, kill_tree, start_node

    prompts = _prompts(512, (20, 17, 3))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cfg = _config(max_num_seqs=4, max_num_batched_tokens=16)
    ref = [s.output_token_ids for s in build_engine(load_model(tiny_qwen3_dir, torch.float32), cfg, use_graph=False)
           .generate(prompts, sp)]

    def launch(port: int) -> NodeLaunch:
        return NodeLaunch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, rendezvous_timeout_s=20)
    port = free_port()
    node1 = start_node("advanced.adv09_overlap.node", tiny_qwen3_dir, port, "--tensor-parallel-size", "2")
    try:
        with OverlapEngine(tiny_qwen3_dir, cfg, tensor_parallel_size=2, dtype=torch.float32, threads_per_rank=1,
                           launch=launch(port)) as engine:
            assert engine.workers == []                          # rank 1 lives on "node 1"
            assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
            assert len(engine.collect_timelines()) == 6          # its rows come over the control socket
        out = gone(node1)
        assert node1.returncode == 0, out
    finally:
        kill_tree(node1)
    port = free_port()
    lesson17 = start_node("step17_tensor_parallel.node", tiny_qwen3_dir, port, "--tensor-parallel-size", "2")
    try:
        with pytest.raises(RendezvousError, match="two-batch overlap"):
            OverlapEngine(tiny_qwen3_dir, cfg, tensor_parallel_size=2, dtype=torch.float32, launch=launch(port))
        out = gone(lesson17)
        assert lesson17.returncode == 2 and "refused by rank 0" in out, out
    finally:
        kill_tree(lesson17)
