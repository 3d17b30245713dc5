"""Lesson 16: graph capture. The runner pads decode steps to a bucket and runs a recorded program
(compiled layer body on a CPU, CUDA graph on a GPU) on static buffers; its engine equals the
eager engines token for token, pads write only into the scratch block (which the block manager
never hands out), each bucket is compiled once for all layers, and the runner runs eagerly
where it cannot compile."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step14_batched_forward.packed_linear import PackedLinear, can_pack, count_modules
from step15_flash_attention import flash_cpu
from step16_cuda_graph import engine as engine_module
from step16_cuda_graph import runner as runner_module
from step16_cuda_graph.engine import build_engine
from step16_cuda_graph.runner import GraphRunner, batch_buckets

needs_kernel = pytest.mark.skipif(flash_cpu.load() is None, reason="no C++ compiler for the kernel")


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, torch.float32)


def _config(model, blocks=60, max_num_seqs=4, budget=16):
    return PagedSchedulerConfig(block_size=4, kv_cache_bytes=blocks * KVPool.bytes_per_block(model.config, 4, torch.float32),
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def _prompts(model, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def model_state(model: torch.nn.Module) -> tuple[dict, dict]:
    """What a model is made of: each submodule (by name: the object and its type) and each
    parameter and buffer (by name: the object and a copy of its values)."""
    modules = {name: (id(m), type(m)) for name, m in model.named_modules()}
    tensors = {name: (t, t.detach().clone()) for name, t in
               list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))}
    return modules, tensors


def assert_unchanged(model: torch.nn.Module, before: tuple[dict, dict]) -> None:
    modules, tensors = model_state(model)
    assert modules == before[0], "the model's modules were replaced or added"
    assert tensors.keys() == before[1].keys()
    for name, (t, _) in tensors.items():
        old, values = before[1][name]
        assert t is old, f"{name} is another tensor"
        assert torch.equal(t, values), f"{name} changed values"


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(64, step=8) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20, step=8) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="8 or 16"):
        batch_buckets(64, step=4)


@needs_kernel
def test_engine_equals_naive_with_chunks_prefix_hits_and_eager_overflow(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    bpb = KVPool.bytes_per_block(smol_fp32.config, 16, torch.float32)
    engine = build_engine(smol_fp32, PagedSchedulerConfig(kv_cache_bytes=400 * bpb, max_num_seqs=6,
                                                          max_num_batched_tokens=24), max_bucket=4)
    runner = engine.runner
    assert type(runner) is GraphRunner and runner.mode == "compile" and runner.buckets == [1, 2, 4]
    assert runner.ready == {1, 2, 4}                    # record_now: every bucket compiled before serving
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # chunked prefill
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # prefix-cache hits
    used = {b for b, n in runner.replays.items() if n}
    assert len(used) >= 2, f"decode steps should hit several buckets, got {runner.replays}"
    assert sum(runner.replays.values()) < engine.num_steps   # prompt steps and 5-6 decodes > bucket 4: eager
    # The scratch block is the pool's last block, outside the block manager: nothing holds it.
    assert engine.kv_pool.num_blocks == engine.scheduler.block_manager.num_blocks + 1
    assert runner.scratch_block == engine.kv_pool.num_blocks - 1
    assert engine.stats().kv_blocks_used == 0


@needs_kernel
def test_compiled_engine_leaves_the_linears_unpacked(tiny):
    """Inductor cannot take oneDNN's packed weights as graph inputs: the compiled CPU engine runs
    lesson 04's nn.Linear; lesson 15's eager engine (use_graph=False) packs them as before."""
    compiled = build_engine(tiny, _config(tiny, max_num_seqs=2), record_now=False)
    eager = build_engine(tiny, _config(tiny, max_num_seqs=2), use_graph=False)
    assert compiled.runner.mode == "compile" and count_modules(compiled.model, PackedLinear) == 0
    assert type(eager.runner) is not GraphRunner
    assert count_modules(eager.model, PackedLinear) == (7 * tiny.config.num_layers if can_pack(torch.float32) else 0)
    assert count_modules(tiny, PackedLinear) == 0         # packing made a copy: the given model is as it was


@needs_kernel
def test_equals_lesson14_under_preemption(tiny):
    prompts = _prompts(tiny, (3, 40, 17, 64, 9))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = _config(tiny, blocks=30)
    ref = [s.output_token_ids for s in BatchedEngine(tiny, config, pack_weights=False).generate(prompts, sp)]
    engine = build_engine(tiny, config)
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert engine.scheduler.num_preemptions > 0 and sum(engine.runner.replays.values()) > 0


@needs_kernel
def test_padding_never_touches_live_kv(tiny):
    """Run the graph engine and lesson 15's eager one (same unpacked weights) in lockstep: after
    every step each sequence's K/V, read through its own block table, is the same in both pools;
    no sequence owns the scratch block, and the pads wrote there."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    graph = build_engine(tiny, _config(tiny))
    eager = build_engine(tiny, _config(tiny), use_graph=False, pack_weights=False)
    scratch = graph.runner.scratch_block
    assert graph.scheduler.block_manager.num_blocks == eager.scheduler.block_manager.num_blocks   # same schedule
    pairs = []
    for prompt in _prompts(tiny, (5, 9, 14)):                   # 3 decodes -> bucket 4: one padded row
        pairs.append((graph.add_request(prompt, sp), eager.add_request(prompt, sp)))
    while graph.has_unfinished():
        graph.step(), eager.step()
        for g, e in pairs:
            if g.is_finished:
                continue
            assert scratch not in g.block_table and g.num_computed_tokens == e.num_computed_tokens
            for layer in range(tiny.config.num_layers):
                for gk, ek in zip(graph.kv_pool.gather(layer, torch.tensor(g.block_table), g.num_computed_tokens),
                                  eager.kv_pool.gather(layer, torch.tensor(e.block_table), e.num_computed_tokens)):
                    torch.testing.assert_close(gk, ek, rtol=1e-5, atol=1e-5)
    assert graph.runner.replays[4] > 0 and not eager.has_unfinished()
    assert [g.output_token_ids for g, _ in pairs] == [e.output_token_ids for _, e in pairs]
    assert graph.kv_pool.k[0][scratch].abs().sum() > 0          # the pads did write, there


@needs_kernel
def test_static_buffers_reused_and_one_compile_per_bucket(tiny):
    engine = build_engine(tiny, _config(tiny, max_num_seqs=2), record_now=False)
    runner = engine.runner
    assert runner.ready == set() and runner.replays == {1: 0, 2: 0}   # record_now=False: nothing recorded yet
    s = runner.static
    ptrs = [t.data_ptr() for t in (s.input_ids, s.positions, s.slot_mapping, s.rows, s.seq_lens, s.block_tables)]
    before = counters["stats"]["unique_graphs"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.generate(_prompts(tiny, (4, 11), seed=3), sp)          # one prompt step, then 5 decodes of 2
    assert [t.data_ptr() for t in (s.input_ids, s.positions, s.slot_mapping, s.rows, s.seq_lens,
                                   s.block_tables)] == ptrs
    assert runner.replays == {1: 0, 2: 5} and runner.ready == {2}   # recorded when first used
    # One compiled layer body per bucket (or none if this shape was compiled earlier in the run):
    # the layers share it instead of compiling num_layers copies.
    assert counters["stats"]["unique_graphs"] - before <= 1


@needs_kernel
def test_a_dropped_engine_is_freed(tiny):
    """Compiled code lives in Dynamo's caches for the rest of the process; what it keeps must not
    hold the runner (and with it the KV pool)."""
    engine = build_engine(tiny, _config(tiny, max_num_seqs=2))
    assert engine.runner.ready == {1, 2}
    runner, pool = weakref.ref(engine.runner), weakref.ref(engine.kv_pool)
    del engine
    gc.collect()
    assert runner() is None and pool() is None


@needs_kernel
def test_falls_back_to_eager_without_compile(monkeypatch, tiny):
    """Without a working torch.compile the runner keeps its buckets, static buffers and scratch
    block but runs each bucket eagerly (and the linears are packed again): lesson 15's tokens."""
    prompts = _prompts(tiny, (6, 13))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [s.output_token_ids for s in build_engine(tiny, _config(tiny), use_graph=False).generate(prompts, sp)]
    monkeypatch.setattr(engine_module, "compile_works", lambda: False)
    monkeypatch.setattr(runner_module, "compile_works", lambda: False)
    engine = build_engine(tiny, _config(tiny))
    assert engine.runner.mode == "eager"
    assert count_modules(engine.model, PackedLinear) == (7 * tiny.config.num_layers if can_pack(torch.float32) else 0)
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert sum(engine.runner.replays.values()) > 0          # decode steps still padded to buckets


@needs_kernel
def test_bad_block_table_is_refused_before_the_kernel(tiny):
    engine = build_engine(tiny, _config(tiny), record_now=False)
    seq = engine.add_request(_prompts(tiny, (6,))[0], SamplingParams(temperature=0, max_tokens=4))
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        engine.step()
    batch = engine.scheduler.schedule()
    assert engine.runner.bucket_for(batch) == 1
    seq.block_table[0] = engine.kv_pool.num_blocks + 7                  # corrupt: a block outside the pool
    with pytest.raises(ValueError, match="outside the pool"):
        engine.runner.prepare(batch, 1)


@needs_kernel
def test_the_scratch_block_is_outside_the_block_manager(tiny):
    """The pool has one block more than the block manager hands out, so the scheduler's own
    admission check is the right one: a request needing every block of the manager completes
    (pads never take its blocks), one needing a block more is refused up front."""
    engine = build_engine(tiny, _config(tiny, blocks=10, max_num_seqs=2), record_now=False)
    assert engine.scheduler.block_manager.num_blocks == 10 and engine.kv_pool.num_blocks == 11
    assert engine.runner.scratch_block == 10
    prompt = _prompts(tiny, (20,))[0]
    with pytest.raises(ValueError, match="could never finish"):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=22, ignore_eos=True))   # 41 tokens
    assert not engine.has_unfinished()
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))  # 40 tokens
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and len(seq.output_token_ids) == 21
    assert sum(engine.runner.replays.values()) == 20 and engine.scheduler.num_preemptions == 0


@needs_kernel
def test_building_an_engine_leaves_the_model_as_it_was(tiny):
    before = model_state(tiny)
    for options in ({}, {"use_graph": False}, {"use_graph": False, "pack_weights": False}):
        engine = build_engine(tiny, _config(tiny, max_num_seqs=2), **options)
        engine.generate(_prompts(tiny, (5, 9)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert_unchanged(tiny, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_engine_gives_the_tokens_of_the_cpu_engine(tiny_qwen3_dir):
    from step15_flash_attention import engine as lesson15
    from step15_flash_attention.triton_attention import triton_available
    if not triton_available():
        pytest.skip("no Triton for CUDA here")
    model = load_model(tiny_qwen3_dir, torch.float32)
    prompts = _prompts(model, [5, 17, 30, 9, 40, 3])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [s.output_token_ids for s in lesson15.build_engine(model, _config(model), attention_backend="torch",
                                                               pack_weights=False).generate(prompts, sp)]
    engine = build_engine(model.to("cuda"), _config(model), attention_backend="triton")
    assert engine.runner.mode == "cuda-graph" and engine.kv_pool.k[0].is_cuda
    assert set(engine.runner.graphs) == set(engine.runner.buckets)
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert sum(engine.runner.replays.values()) > 0       # decode steps went through the graphs
