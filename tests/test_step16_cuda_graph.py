"""Lesson 16: the decode runner with per-bucket compiled steps equals the eager engines token for
token, pads never touch live K/V, each bucket is compiled once for all layers, and it falls back
to eager where it cannot compile."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention import flash_cpu
from step16_cuda_graph import engine as engine_module
from step16_cuda_graph.engine import GraphEngine
from step16_cuda_graph.runner import batch_buckets

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


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


@needs_kernel
def test_engine_equals_naive_with_chunks_prefix_hits_and_eager_overflow(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    bpb = KVPool.bytes_per_block(smol_fp32.config, 16, torch.float32)
    engine = GraphEngine(smol_fp32, PagedSchedulerConfig(kv_cache_bytes=400 * bpb, max_num_seqs=6,
                                                         max_num_batched_tokens=24), max_bucket=4)
    assert engine.runner is not None and engine.runner.buckets == [1, 2, 4]
    assert set(engine.runner.direct) == {1, 2, 4}      # every bucket's body called without Dynamo
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # chunked prefill
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # prefix-cache hits
    replays = engine.runner.replays
    assert len(replays) >= 2, f"decode steps should hit several buckets, got {dict(replays)}"
    assert sum(replays.values()) < engine.num_steps     # 5 decodes > bucket 4: those steps ran eagerly
    assert engine.mixed is not None and engine.mixed.steps > 0   # prompt steps: the dynamic compiled body
    assert engine.stats().kv_blocks_used == 1                 # the scratch block, held for good


@needs_kernel
def test_compiled_prompt_steps_equal_eager_ones(tiny):
    """Chunks of many lengths (the token count is dynamic): same tokens as prompt steps run eagerly."""
    prompts = _prompts(tiny, (3, 40, 17, 64, 9, 33))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = GraphEngine(tiny, _config(tiny), compile_mixed=False)
    ref = [s.output_token_ids for s in eager.generate(prompts, sp)]
    engine = GraphEngine(tiny, _config(tiny))
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert eager.mixed is None and engine.mixed.steps > 1
    bad = SimpleNamespace(rows=torch.zeros(2, dtype=torch.long), cu_seqlens_q=torch.tensor([0, 1]),
                          seq_lens=torch.tensor([1]), block_tables=torch.tensor([[engine.kv_pool.num_blocks + 3]]))
    with pytest.raises(ValueError, match="outside the pool"):   # checked once a step, before any layer
        engine.mixed.forward(torch.tensor([5]), torch.tensor([0]), bad)


@needs_kernel
def test_equals_lesson14_under_preemption(tiny):
    prompts = _prompts(tiny, (3, 40, 17, 64, 9))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = _config(tiny, blocks=30)
    ref = [s.output_token_ids for s in BatchedEngine(tiny, config, pack_weights=False).generate(prompts, sp)]
    engine = GraphEngine(tiny, config)
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert engine.scheduler.num_preemptions > 0 and engine.runner.replays


@needs_kernel
def test_padding_never_touches_live_kv(tiny):
    """Run the graph engine and the eager one in lockstep: after every step each sequence's K/V,
    read through its own block table, is the same in both pools; no sequence owns the scratch block."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    graph, eager = GraphEngine(tiny, _config(tiny)), GraphEngine(tiny, _config(tiny), use_graph=False)
    scratch = graph.runner.scratch_block
    pairs = []
    for prompt in _prompts(tiny, (5, 9, 14)):                   # 3 decodes -> bucket 4: one padded row
        pairs.append((graph.add_request(prompt, sp), eager.add_request(prompt, sp)))
    while graph.has_unfinished():
        graph.step(), eager.step()
        for g, e in pairs:
            if g.is_finished:
                continue
            assert scratch not in g.kv and g.num_computed_tokens == e.num_computed_tokens
            for layer in range(tiny.config.num_layers):
                for gk, ek in zip(graph.kv_pool.gather(layer, torch.tensor(g.kv), g.num_computed_tokens),
                                  eager.kv_pool.gather(layer, torch.tensor(e.kv), e.num_computed_tokens)):
                    torch.testing.assert_close(gk, ek, rtol=1e-5, atol=1e-5)
    assert graph.runner.replays[4] > 0 and not eager.has_unfinished()
    assert graph.kv_pool.k[0][scratch].abs().sum() > 0          # the pads did write, there


@needs_kernel
def test_static_buffers_reused_and_one_compile_per_bucket(tiny):
    # Prompt steps eager: the compiled prompt body (its own code per engine) would add its graphs.
    engine = GraphEngine(tiny, _config(tiny, max_num_seqs=2), record_now=False, compile_mixed=False)
    s = engine.runner.static
    ptrs = [t.data_ptr() for t in (s.input_ids, s.positions, s.rows, s.seq_lens, s.block_tables)]
    before = counters["stats"]["unique_graphs"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.generate(_prompts(tiny, (4, 11), seed=3), sp)
    assert [t.data_ptr() for t in (s.input_ids, s.positions, s.rows, s.seq_lens, s.block_tables)] == ptrs
    assert set(engine.runner.replays) == {2} and engine.runner.ready == {2}
    # One compiled layer body per bucket (or none if this shape was compiled earlier in the run):
    # the layers share it instead of compiling num_layers copies.
    assert counters["stats"]["unique_graphs"] - before <= 1


@needs_kernel
def test_direct_calls_give_what_dynamo_gives(tiny):
    """A bucket's compiled body called directly (its inputs found once, by identity, in each
    layer) returns exactly what the same body returns through Dynamo, for every layer."""
    engine = GraphEngine(tiny, _config(tiny, max_num_seqs=2))
    runner = engine.runner
    assert set(runner.direct) == {1, 2}
    engine.generate(_prompts(tiny, (5, 9)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for b in (1, 2):
        direct = runner.forward(b)
        calls, runner.direct = runner.direct, {}
        via_dynamo = runner.forward(b)
        runner.direct = calls
        assert torch.equal(direct, via_dynamo)


@needs_kernel
def test_a_dropped_engine_is_freed(tiny):
    """Dynamo keeps every compile backend it is given in a global table; the runner's backend
    must not hold the runner (its KV pool would never be freed: found 2026-12-04)."""
    import gc
    import weakref
    engine = GraphEngine(tiny, _config(tiny, max_num_seqs=2))
    assert engine.runner.direct
    runner, pool = weakref.ref(engine.runner), weakref.ref(engine.kv_pool)
    del engine
    gc.collect()
    assert runner() is None and pool() is None


@needs_kernel
def test_falls_back_to_eager_without_compile(monkeypatch, tiny):
    prompts = _prompts(tiny, (6, 13))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [s.output_token_ids for s in GraphEngine(tiny, _config(tiny), use_graph=False).generate(prompts, sp)]
    monkeypatch.setattr(engine_module, "compile_works", lambda: False)
    engine = GraphEngine(tiny, _config(tiny))
    assert engine.runner is None
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref


@needs_kernel
def test_bad_block_table_is_refused_before_the_kernel(tiny):
    engine = GraphEngine(tiny, _config(tiny), record_now=False)
    seq = engine.add_request(_prompts(tiny, (6,))[0], SamplingParams(temperature=0, max_tokens=4))
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        engine.step()
    batch = engine.scheduler.schedule()
    assert engine.runner.bucket_for(batch) == 1
    seq.kv[0] = engine.kv_pool.num_blocks + 7                  # corrupt: a block outside the pool
    with pytest.raises(ValueError, match="outside the pool"):
        engine.runner.prepare(batch, 1)


@needs_kernel
def test_a_request_must_fit_without_the_scratch_block(tiny):
    """The scheduler counts the whole pool; the runner keeps one block. A request needing every
    block would preempt itself forever: it is refused up front, and one block less completes."""
    engine = GraphEngine(tiny, _config(tiny, blocks=10, max_num_seqs=2), record_now=False)
    assert engine.scheduler.block_manager.num_blocks == 10
    prompt = _prompts(tiny, (20,))[0]
    with pytest.raises(ValueError, match="scratch block"):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))   # 40 tokens
    assert not engine.has_unfinished()
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))  # 36 tokens
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and len(seq.output_token_ids) == 17


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_engine_gives_the_tokens_of_the_cpu_engine(tiny_qwen3_dir):
    from step15_flash_attention.engine import FlashEngine
    from step15_flash_attention.triton_attention import triton_available
    if not triton_available():
        pytest.skip("no Triton for CUDA here")
    model = load_model(tiny_qwen3_dir, torch.float32)
    prompts = _prompts(model, [5, 17, 30, 9, 40, 3])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [s.output_token_ids for s in FlashEngine(model, _config(model), attention_backend="torch",
                                                    use_kernel=False).generate(prompts, sp)]
    engine = GraphEngine(model.to("cuda"), _config(model), attention_backend="triton", use_kernel=False)
    assert engine.runner.mode == "cuda-graph" and engine.kv_pool.k[0].is_cuda
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert sum(engine.runner.replays.values()) > 0       # decode steps went through the graphs
