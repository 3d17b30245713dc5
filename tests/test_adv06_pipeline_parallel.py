"""Advanced lesson 06: pipeline parallelism. The partition rule; stage models that chain to the
full model (the LM head on rank 0, tied or not); PP engines with several micro-batches in flight
and chunked prefill giving the single-process tokens (fp32); every worker fault a clear error in
seconds with nothing left running; a timeline that validates. Across machines:
test_adv06_multi_node.py."""
from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm_support.timeline import bubble_formula, chrome_trace, validate_trace
from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model
from step04_transformer.model import SingleSequenceAttention
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.engine import WorkerFailed
from step17_tensor_parallel.worker import model_bytes
from advanced.adv06_pipeline_parallel.costmodel import (bubble_fractions, fit_hop, fit_lm_head, fit_stage_costs,
                                                        head_spans, hop_samples, layer_spans, micro_batches,
                                                        predict_seconds, rank0_overhead)
from advanced.adv06_pipeline_parallel.engine import PPEngine
from advanced.adv06_pipeline_parallel.partition import PARTITION_ENV, partition_layers
from advanced.adv06_pipeline_parallel.stage import Stage, load_stage
from advanced.adv06_pipeline_parallel.worker import FAULT_ENV
from tests.processes import our_children


def _prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- the partition rule -------------------------------------------------------------------------
def test_partition_even_remainder_and_override(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert partition_layers(30, 2) == [(0, 15), (15, 30)]
    assert partition_layers(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]   # extras in the middle
    assert partition_layers(11, 4) == [(0, 3), (3, 6), (6, 9), (9, 11)]      # remainder p-1 reaches stage 0
    assert partition_layers(5, 1) == [(0, 5)]
    assert partition_layers(30, 2, [10, 20]) == [(0, 10), (10, 30)]
    assert partition_layers(30, 3, "5,20,5") == [(0, 5), (5, 25), (25, 30)]
    monkeypatch.setenv(PARTITION_ENV, "12,18")
    assert partition_layers(30, 2) == [(0, 12), (12, 30)]


@pytest.mark.parametrize("override, message", [
    ([10, 10], "adds up to 20 layers, the model has 30"),
    ([30], "has 1 entries for pipeline_parallel_size=2"),
    ([31, -1], "every stage needs at least one layer"),
    ("ten,twenty", "must be comma-separated layer counts"),
])
def test_bad_partition_is_a_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        partition_layers(30, 2, override)


def test_impossible_splits_are_refused_before_any_process(tiny_qwen3_dir, no_leftovers):
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        PPEngine(tiny_qwen3_dir, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        partition_layers(2, 0)
    with pytest.raises(ValueError, match="adds up to 3 layers"):
        PPEngine(tiny_qwen3_dir, pipeline_parallel_size=2, layer_partition=[1, 2])
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        PPEngine(tiny_qwen3_dir, pipeline_parallel_size=2, num_micro_batches=0)
    with pytest.raises(ValueError, match="cannot be shared by 2 micro-batches"):
        PPEngine(tiny_qwen3_dir, PagedSchedulerConfig(block_size=4, kv_cache_bytes=600), pipeline_parallel_size=2)
    assert our_children() == []


# ---- stage models -----------------------------------------------------------------------------
def test_stages_chain_to_the_full_model_and_load_only_their_tensors(tiny4):
    full = load_model(tiny4, torch.float32)
    cfg = full.config
    ids, pos = torch.tensor([1, 5, 77, 300, 12]), torch.arange(5)
    ref = full.compute_logits(full(ids, pos))
    stages = [load_stage(tiny4, Stage(i, 3, a, b), torch.float32)
              for i, (a, b) in enumerate(partition_layers(cfg.num_layers, 3))]      # layers 0 | 1-2 | 3
    hidden = None
    for st in stages:
        hidden = st(ids, pos, SingleSequenceAttention(), hidden)
    assert torch.equal(stages[0].compute_logits(hidden), ref)          # the LM head is on rank 0
    names = [set(n for n, _ in st.named_parameters()) for st in stages]
    assert "model.embed_tokens.weight" in names[0] and "model.embed_tokens.weight" not in names[2]
    assert "model.norm.weight" in names[2] and "model.norm.weight" not in names[0]
    assert {n.split(".")[2] for n in names[1]} == {"1", "2"}                    # nothing but layers 1-2
    layer_names = [n for part in names for n in part if n.startswith("model.layers.")]
    assert sorted(layer_names) == sorted(n for n, _ in full.named_parameters() if n.startswith("model.layers."))


def test_stage_loader_is_strict(tmp_path, tiny4):
    tensors = load_file(str(tiny4 / "model.safetensors"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text((tiny4 / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "model.layers.3.mlp.up_proj.weight"},
              str(folder / "model.safetensors"))
    load_stage(folder, Stage(0, 2, 0, 2), torch.float32)                  # stage 0 does not need it
    with pytest.raises(KeyError, match="model.layers.3.mlp.up_proj"):
        load_stage(folder, Stage(1, 2, 2, 4), torch.float32)
    save_file({**tensors, "model.layers.1.extra": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.extra"):
        load_stage(folder, Stage(0, 2, 0, 2), torch.float32)
    bad = dict(tensors)
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1].contiguous()
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_stage(folder, Stage(1, 2, 2, 4), torch.float32)


# ---- engines: the tokens of one process ------------------------------------------------------
@pytest.mark.slow          # ~5 s: CI runs it (make test-slow)
def test_pp3_equals_single_process_on_tiny_with_micro_batches_in_flight(tiny4, no_leftovers):
    """3 stages (one in the middle), 1, 2 and 4 micro-batches, chunked prefill (16-token budget)."""
    prompts = _prompts(512, (3, 40, 17, 64, 9, 30))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cfg = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, kv_cache_bytes=2**20)
    ref = [s.output_token_ids for s in build_engine(load_model(tiny4, torch.float32), cfg, use_graph=False)
           .generate(prompts, sp)]
    with PPEngine(tiny4, cfg, pipeline_parallel_size=3, dtype=torch.float32, timeout_s=20) as engine:
        assert len(engine.workers) == 2
        for m in (1, 2, 4):
            engine.set_micro_batches(m)
            assert len(engine.virtual) == m
            assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref, m
        assert engine.bytes_sent["hidden"] > 0 and engine.bytes_sent["returned"] > 0
    assert engine.closed and not any(w.is_alive() for w in engine.workers)
    with PPEngine(tiny4, cfg, pipeline_parallel_size=1, num_micro_batches=2, dtype=torch.float32) as one:
        assert one.workers == [] and [s.output_token_ids for s in one.generate(prompts, sp)] == ref   # p = 1
    engine.close()                                      # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


@pytest.mark.slow
def test_pp2_two_in_flight_equals_one_process_on_smollm2(smol_dir, smol_fp32, smol_prompts, no_leftovers):
    """The embedded model in fp32: 2 stages, 2 micro-batches in flight, prompts chunked by 24
    tokens; the reference is lesson 16's fast-path engine in one process. Greedy, stopping at EOS."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20, 16, 18, 10)]
    cfg = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=16, kv_cache_bytes=64 * 2**20)
    one = build_engine(smol_fp32, cfg, use_graph=False)
    ref = [s.output_token_ids for s in one.generate(smol_prompts, params)]
    assert any(len(r) < sp.max_tokens for r, sp in zip(ref, params))              # some stop at EOS
    with PPEngine(smol_dir, cfg, pipeline_parallel_size=2, num_micro_batches=2, dtype=torch.float32) as engine:
        assert [s.output_token_ids for s in engine.generate(smol_prompts, params)] == ref
        tls = engine.collect_timelines()
        launched = layer_spans(tls[0])
        assert {s.args["micro_batch"] for s in launched} == {0, 1}
        heads = head_spans(tls[0])             # rank 0's LM head over the rows sent back
        assert heads and sum(s.args["rows"] for s in heads) == sum(len(r) for r in ref)
        assert head_spans(tls[1]) == [] and {s.name for s in tls[1].spans if s.cat == "send"} == {"send rows"}
        assert any(s.args["prefill_tokens"] and s.args["decode_tokens"] for s in launched)   # mixed steps
        # Each rank holds its layers; the tied embedding (input and LM head) only on rank 0.
        assert sum(m["weight_bytes"] for m in engine.rank_memory) == model_bytes(smol_fp32)
    # The timeline: valid, one row per rank, every step on both ranks.
    problems = validate_trace(chrome_trace(tls))
    assert problems == []
    steps = [{s.args["step"] for s in tl.spans if s.cat == "compute"} for tl in tls]
    assert steps[0] == steps[1] and len(steps[0]) > 10
    bubbles = bubble_fractions(tls)
    assert len(bubbles) == 2 and all(0 <= b < 1 for b in bubbles)
    costs = fit_stage_costs(tls)
    assert len(costs) == 2 and all(c.per_token_s > 0 for c in costs)
    # What comes back to rank 0: the normed hidden rows it samples, [N, hidden] in the model dtype.
    row_bytes = smol_fp32.config.hidden_size * 4
    assert engine.bytes_sent["returned"] == sum(len(r) for r in ref) * row_bytes
    mbs = micro_batches(tls)
    assert all(mb.returned_bytes == mb.rows * row_bytes for mb in mbs) and sum(mb.rows for mb in mbs) > 0
    assert predict_seconds(mbs, costs, fit_hop(hop_samples(tls)), rank0_overhead(tls[0]), 2,
                           fit_lm_head(tls[0])) > 0
    hops = hop_samples(tls)
    assert hops and all(h.latency_s >= 0 and h.bytes > 0 for h in hops)
    assert bubble_formula(2, 2) == pytest.approx(1 / 3)


# ---- faults ------------------------------------------------------------------------------------
def _tiny_engine(folder, p: int = 2, **kw) -> PPEngine:
    cfg = PagedSchedulerConfig(block_size=4, kv_cache_bytes=2**20)
    return PPEngine(folder, cfg, pipeline_parallel_size=p, dtype=torch.float32, **kw)


def _generate_until_failure(engine: PPEngine, max_steps: int = 100_000) -> WorkerFailed:
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for prompt in _prompts(512, (20, 30, 40)):
        engine.add_request(prompt, sp)
    with pytest.raises(WorkerFailed) as info:
        for _ in range(max_steps):
            engine.step()
    assert engine.closed and not any(w.is_alive() for w in engine.workers)
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    return info.value


@pytest.mark.parametrize("fault, expect", [("raise@3", "rank 1 (stage 1 (layers 2-3))"),
                                           ("exit@3", "rank 1: process ended (exit code 3)")])
def test_last_stage_that_raises_or_exits(tiny4, monkeypatch, fault, expect, no_leftovers):
    monkeypatch.setenv(FAULT_ENV, fault)           # inherited by the spawned stages
    with _tiny_engine(tiny4) as engine:
        t0 = time.perf_counter()
        error = _generate_until_failure(engine)
        assert time.perf_counter() - t0 < 10
        assert expect in str(error)
        if fault.startswith("raise"):
            assert "injected fault" in str(error) and "Traceback" in str(error)


def test_stage_that_is_killed_mid_run(tiny4, no_leftovers):
    with _tiny_engine(tiny4, num_micro_batches=2) as engine:
        engine.generate(_prompts(512, (5, 9)), SamplingParams(max_tokens=5, ignore_eos=True))    # healthy first
        killer = threading.Timer(0.3, os.kill, (engine.workers[0].pid, signal.SIGKILL))
        killer.start()
        t0 = time.perf_counter()
        error = _generate_until_failure(engine)
        killer.join()
        assert time.perf_counter() - t0 < 10
        assert "rank 1: process ended (killed by signal 9)" in str(error)


@pytest.mark.slow
def test_stage_that_hangs_hits_the_timeout(tiny4, monkeypatch, no_leftovers):
    monkeypatch.setenv(FAULT_ENV, "hang@2")
    with _tiny_engine(tiny4, timeout_s=2) as engine:
        t0 = time.perf_counter()
        error = _generate_until_failure(engine)
        assert time.perf_counter() - t0 < 10
        assert "not answering" in str(error) and "Timed out" in str(error)


def test_del_with_a_micro_batch_in_flight_leaves_nothing(tiny4, no_leftovers):
    threads = torch.get_num_threads()
    engine = _tiny_engine(tiny4)
    workers = engine.workers
    try:
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=50))
        engine.step()                                   # left with a micro-batch in flight
        assert engine.has_unfinished() and torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
    except BaseException:
        engine.close()
        raise
    del engine                                          # garbage collection stops the stages
    gc.collect()
    for w in workers:
        w.join(10)
        assert not w.is_alive()
    assert torch.get_num_threads() == threads           # rank 0's thread count restored


def test_untied_model_keeps_its_lm_head_on_rank_0(tmp_path):
    """An untied checkpoint: lm_head.weight belongs to stage 0 (where the logits are computed),
    the strict loader names it when it is missing, and the stages still chain to the full model."""
    folder = build_tiny_qwen3(tmp_path / "untied", num_hidden_layers=4, tie_word_embeddings=False)
    full = load_model(folder, torch.float32)
    ids, pos = torch.tensor([3, 8, 100, 7]), torch.arange(4)
    s0, s1 = load_stage(folder, Stage(0, 2, 0, 2), torch.float32), load_stage(folder, Stage(1, 2, 2, 4), torch.float32)
    assert "lm_head.weight" in dict(s0.named_parameters()) and s1.lm_head is None
    hidden = s1(ids, pos, SingleSequenceAttention(), s0(ids, pos, SingleSequenceAttention()))
    assert torch.equal(s0.compute_logits(hidden), full.compute_logits(full(ids, pos)))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    load_stage(folder, Stage(1, 2, 2, 4), torch.float32)                  # the last stage does not need it
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_stage(folder, Stage(0, 2, 0, 2), torch.float32)
