"""Lesson 16, part 2: the CPU fast path on top of lesson 16's runner. Each part against what it replaces:
the attention op's prompt chunks (SDPA or AMX tiles), fused q|k|v and gate|up projections (bit
for bit), the model transforms (new models; the given one untouched), elementwise.cpp's passes
(its AVX-512 BF16 build or the portable one), the C argmax, the packed LM head, direct calls of
what inductor built for every bucket, the dynamic compiled prompt step; and the engine built
from them token for token against lessons 05 and 14, falling back to lesson 16's engine where
it cannot compile."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step14_batched_forward.packed_linear import PackedLinear, can_pack, count_modules, pack_linears
from step15_flash_attention import amx_prefill, flash_cpu
from step16_cuda_graph import engine as lesson16_engine
from step16_cuda_graph import runner as lesson16_runner
from step16_cuda_graph.runner import GraphRunner
from step16_cuda_graph.cpu import engine as engine_module
from step16_cuda_graph.cpu.engine import KernelSampler, build_engine, cpu_fast_path
from step16_cuda_graph.cpu.fused import FusedQKVAttention, FusedSwiGLU, count_fused, fuse_projections
from step16_cuda_graph.cpu.huge_pages import HugePageKVPool
from step16_cuda_graph.cpu.ops import OpPackedLinear, route_packed_linears
from step16_cuda_graph.cpu.runner import CpuGraphRunner
from tests.test_step16_cuda_graph import _config, _prompts, assert_unchanged, model_state

needs_kernel = pytest.mark.skipif(flash_cpu.load() is None, reason="no C++ compiler for the kernel")


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, torch.float32)


@pytest.mark.skipif(flash_cpu.load() is None, reason="no C++ compiler: lesson 15's kernel is unavailable")
@pytest.mark.parametrize("path", ["kernel", "amx"])
@pytest.mark.parametrize("Hq, Hkv, D, bs, n_q, lens", [
    (4, 2, 64, 16, [5, 1, 24, 1], [30, 17, 24, 40]),          # later chunk, decode, fresh prompt, decode
    (6, 2, 128, 4, [37, 1, 70, 2], [101, 9, 70, 33]),          # 3 heads a group, tiny blocks, many tiles
])
def test_bf16_prompt_chunks_match_the_kernel(monkeypatch, path, Hq, Hkv, D, bs, n_q, lens):
    """A bf16 step mixing fresh prompts, later chunks of prompts and decodes: the op gives lesson
    15's kernel's result on the whole batch. With AMX tiles (prompt chunks on the tiles, decodes
    a sub-batch of lesson 15's kernel) to bf16 rounding, decodes exactly; without them it is
    lesson 15's kernel, bit for bit."""
    from step16_cuda_graph.cpu import ops
    if path == "amx" and amx_prefill.amx_library() is None:
        pytest.skip("no AMX tiles on this CPU (or no compiler)")
    if path == "kernel":
        monkeypatch.setattr(ops, "amx_prefill_fits", lambda q, k_cache: False)
    g = torch.Generator().manual_seed(0)
    width = max(-(-L // bs) for L in lens)
    pool_blocks = sum(-(-n // bs) for n in lens) + 1
    k_cache = torch.randn(pool_blocks, Hkv, bs, D, generator=g).bfloat16()
    v_cache = torch.randn(pool_blocks, Hkv, bs, D, generator=g).bfloat16()
    perm = torch.randperm(pool_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    rows = []
    for b, (n, L) in enumerate(zip(n_q, lens)):
        for j in range(-(-L // bs)):
            tables[b, j] = perm.pop()
        for pos in range(L - n, L):                   # where this step's K/V rows land (head-major)
            rows.append([(tables[b, pos // bs] * Hkv + h) * bs + pos % bs for h in range(Hkv)])
    T = sum(n_q)
    q = torch.randn(T, Hq, D, generator=g).bfloat16()
    k = torch.randn(T, Hkv, D, generator=g).bfloat16()
    v = torch.randn(T, Hkv, D, generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()])
    rows = torch.tensor(rows).flatten()
    kc, vc = k_cache.clone(), v_cache.clone()
    out = ops.paged_attention(q, k, v, kc, vc, rows, cu, torch.tensor(lens), tables)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k.view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
    ref_v.view(-1, D).index_copy_(0, rows, v.reshape(-1, D))
    ref = flash_cpu.flash_attention_cpu(q, ref_k, ref_v, cu, torch.tensor(lens), tables)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    if path == "kernel":
        assert torch.equal(out, ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for b, n in enumerate(n_q):
        if n == 1:                                    # the decodes: same kernel, same bits
            assert torch.equal(out[cu[b]], ref[cu[b]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_give_the_same_numbers(tiny_qwen3_dir, dtype):
    """Packed as lesson 14 packs: q|k|v and gate|up as one matmul each change no bit of the
    forward pass; a model fused already has nothing left to fuse, and one whose linears are not
    packed is left alone."""
    if not can_pack(dtype):
        pytest.skip(f"no oneDNN {dtype} packing on this CPU")
    plain = pack_linears(load_model(tiny_qwen3_dir, dtype))
    fused = fuse_projections(plain)
    layers = plain.config.num_layers
    assert count_fused(fused) == 2 * layers and count_fused(plain) == 0
    assert fuse_projections(fused) is fused                   # nothing left to replace: the same model
    assert all(type(layer.self_attn) is FusedQKVAttention and type(layer.mlp) is FusedSwiGLU
               for layer in fused.model.layers)
    assert count_modules(fused, PackedLinear) == 4 * layers    # qkv, o, gate_up, down
    ids = torch.tensor(_prompts(plain, (37,))[0])
    with torch.inference_mode():
        assert torch.equal(plain(ids, torch.arange(37)), fused(ids, torch.arange(37)))
    unpacked = load_model(tiny_qwen3_dir, dtype)
    assert fuse_projections(unpacked) is unpacked and count_fused(unpacked) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transforms_return_new_models_and_leave_their_input_alone(tiny_qwen3_dir, dtype):
    """pack_linears, fuse_projections, route_packed_linears and cpu_fast_path each return a new
    model (sharing what they did not replace: the embedding, the norms) and leave the model they
    were given as it was: the same modules, the same tensors, the same values."""
    if not can_pack(dtype):
        pytest.skip(f"no oneDNN {dtype} packing on this CPU: the transforms have nothing to do")
    model = load_model(tiny_qwen3_dir, dtype)
    before = model_state(model)
    packed = pack_linears(model)
    fused = fuse_projections(packed, kernels=True)
    routed = route_packed_linears(fused)
    fast = cpu_fast_path(model)
    layers = model.config.num_layers
    for new, old in ((packed, model), (fused, packed), (routed, fused), (fast, model)):
        assert new is not old and new.model.embed_tokens.weight is model.model.embed_tokens.weight
        assert new.model.norm is model.model.norm
    assert_unchanged(model, before)
    assert count_modules(model, PackedLinear) == 0 and count_fused(model) == 0
    assert count_modules(packed, PackedLinear) == 7 * layers and count_fused(packed) == 0
    assert count_fused(fused) == 2 * layers and count_modules(fused, OpPackedLinear) == 0
    assert count_modules(routed, OpPackedLinear) == 4 * layers and count_modules(routed, PackedLinear) == 0
    assert count_fused(fast) == 2 * layers and count_modules(fast, OpPackedLinear) == 4 * layers
    ids = torch.tensor(_prompts(model, (21,))[0])
    with torch.inference_mode():                 # eager, the routed linears call lesson 14's code: same bits
        want = fused(ids, torch.arange(21))
        assert torch.equal(routed(ids, torch.arange(21)), want) and torch.equal(fast(ids, torch.arange(21)), want)


@needs_kernel
def test_building_an_engine_leaves_the_model_as_it_was(tiny):
    """The engine runs its own transformed copy (engine.model); the model handed to
    build_engine keeps its modules, tensors and values, compiled or not."""
    before = model_state(tiny)
    for options in ({}, {"use_graph": False}):
        engine = build_engine(tiny, _config(tiny, max_num_seqs=2), **options)
        engine.generate(_prompts(tiny, (5, 9)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert engine.model is not tiny
        assert_unchanged(tiny, before)


@needs_kernel
def test_engine_equals_naive_with_chunks_prefix_hits_and_eager_overflow(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    bpb = KVPool.bytes_per_block(smol_fp32.config, 16, torch.float32)
    engine = build_engine(smol_fp32, PagedSchedulerConfig(kv_cache_bytes=400 * bpb, max_num_seqs=6,
                                                          max_num_batched_tokens=24), max_bucket=4)
    runner = engine.runner
    assert type(runner) is CpuGraphRunner and runner.buckets == [1, 2, 4]
    assert set(runner.direct) | set(runner.one_call_steps) == {1, 2, 4}     # no bucket through Dynamo
    assert isinstance(engine.sampler, KernelSampler)
    assert (runner.lm_head is not None) == can_pack(torch.float32)
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # chunked prefill
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref       # prefix-cache hits
    used = {b for b, n in runner.replays.items() if n}
    assert len(used) >= 2, f"decode steps should hit several buckets, got {runner.replays}"
    assert sum(runner.replays.values()) < engine.num_steps   # 5-6 decodes > bucket 4: not a bucket
    assert runner.mixed is not None and runner.mixed.steps > 0   # prompt steps: the dynamic compiled body
    assert engine.stats().kv_blocks_used == 0                 # the scratch block is outside the block manager


@needs_kernel
def test_compiled_prompt_steps_equal_eager_ones(tiny):
    """Chunks of many lengths (the token count is dynamic): same tokens as prompt steps run eagerly,
    and as lesson 14."""
    prompts = _prompts(tiny, (3, 40, 17, 64, 9, 33))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = build_engine(tiny, _config(tiny), compile_mixed=False)
    ref = [s.output_token_ids for s in eager.generate(prompts, sp)]
    assert ref == [s.output_token_ids for s in BatchedEngine(tiny, _config(tiny), pack_weights=False)
                   .generate(prompts, sp)]
    engine = build_engine(tiny, _config(tiny))
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert eager.runner.mixed is None and engine.runner.mixed.steps > 1
    bad = SimpleNamespace(rows=torch.zeros(2, dtype=torch.long), cu_seqlens_q=torch.tensor([0, 1]),
                          seq_lens=torch.tensor([1]), block_tables=torch.tensor([[engine.kv_pool.num_blocks + 3]]))
    with pytest.raises(ValueError, match="outside the pool"):   # checked once a step, before any layer
        engine.runner.mixed.forward(torch.tensor([5]), torch.tensor([0]), bad)


@needs_kernel
def test_equals_lesson14_under_preemption(tiny):
    prompts = _prompts(tiny, (3, 40, 17, 64, 9))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = _config(tiny, blocks=30)
    ref = [s.output_token_ids for s in BatchedEngine(tiny, config, pack_weights=False).generate(prompts, sp)]
    engine = build_engine(tiny, config)
    assert type(engine.runner) is CpuGraphRunner and type(engine.kv_pool) is HugePageKVPool
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert engine.scheduler.num_preemptions > 0 and sum(engine.runner.replays.values()) > 0


@needs_kernel
def test_decode_steps_that_would_pad_run_at_their_own_size(tiny):
    """Buckets replay when filled or of <= pad_up_to rows; 5-7 sequences run unpadded, as lesson 14."""
    runner = (engine := build_engine(tiny, config := _config(tiny, blocks=120, max_num_seqs=8, budget=64))).runner
    decodes = lambda n: SimpleNamespace(seqs=[None] * n, num_tokens=[1] * n)
    assert [runner.bucket_for(decodes(n)) for n in (1, 3, 4, 5, 7, 8, 9)] == [1, 4, 4, None, None, 8, None]
    assert runner.bucket_for(SimpleNamespace(seqs=[None] * 2, num_tokens=[1, 3])) is None
    prompts = _prompts(tiny, (3, 40, 17, 9, 12, 25, 6))
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = [s.output_token_ids for s in BatchedEngine(tiny, config, pack_weights=False).generate(prompts, sp)]
    steps = runner.mixed.steps
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert runner.replays[8] == 0 and runner.mixed.steps - steps >= 9     # 7 rows: no pad to 8
    eight = engine.generate(prompts + prompts[:1], sp)                   # 8 rows fill the bucket
    assert [s.output_token_ids for s in eight][:7] == ref and runner.replays[8] > 0


@needs_kernel
def test_direct_calls_give_what_dynamo_gives(tiny):
    """A bucket's compiled body called directly (its inputs found once, by identity, in each
    layer) returns exactly what the same body returns through Dynamo, for every layer."""
    engine = build_engine(tiny, _config(tiny, max_num_seqs=2), one_call=False)     # compiled, not plans
    runner = engine.runner
    assert set(runner.direct) == set(runner.buckets) == {1, 2}
    engine.generate(_prompts(tiny, (5, 9)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert runner.replays[1] + runner.replays[2] > 0
    with torch.inference_mode():
        for b in (1, 2):
            direct = runner.decode(b)
            calls, runner.direct = runner.direct, {}
            via_dynamo = runner.decode(b)
            runner.direct = calls
            assert torch.equal(direct, via_dynamo)
    without = build_engine(tiny, _config(tiny, max_num_seqs=2), direct_calls=False)
    assert without.runner.direct == {} and without.runner.ready == {1, 2}


@needs_kernel
def test_a_dropped_engine_is_freed(tiny):
    """Dynamo keeps every compile backend it is given in a global table; the runner's backend
    must not hold the runner (its KV pool would never be freed: found 2026-12-04)."""
    engine = build_engine(tiny, _config(tiny, max_num_seqs=2), one_call=False)
    assert engine.runner.direct
    runner, pool = weakref.ref(engine.runner), weakref.ref(engine.kv_pool)
    del engine
    gc.collect()
    assert runner() is None and pool() is None


@needs_kernel
def test_packed_head_gives_the_models_logits_in_one_buffer(tiny):
    """The LM head: a packed copy of the (tied) embedding where oneDNN packs this dtype, logits
    to float rounding of lesson 04's head, float32 step after step (in float32 the head's own
    output, not copied; bf16 logits are widened into one float32 buffer)."""
    if not can_pack(torch.float32):
        pytest.skip("no oneDNN float32 packing on this CPU")
    engine = build_engine(tiny, _config(tiny, max_num_seqs=2), record_now=False)
    runner = engine.runner
    assert isinstance(runner.lm_head, PackedLinear)
    g = torch.Generator().manual_seed(0)
    h1, h2 = (torch.randn(n, tiny.config.hidden_size, generator=g) for n in (2, 1))
    with torch.inference_mode():
        want1, want2 = tiny.compute_logits(h1), tiny.compute_logits(h2)
        got1 = runner.compute_logits(h1)
        torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)
        got2 = runner.compute_logits(h2)
    assert got2.dtype == torch.float32 and got2.shape == want2.shape
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_falls_back_to_lesson16_where_it_cannot_compile(monkeypatch, tiny):
    """Another attention backend, or no working torch.compile: lesson 16's engine (its runner,
    eager buckets), with the same tokens as lesson 14."""
    prompts = _prompts(tiny, (6, 13))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [s.output_token_ids for s in BatchedEngine(tiny, _config(tiny), pack_weights=False).generate(prompts, sp)]
    other = build_engine(tiny, _config(tiny), attention_backend="torch")
    assert type(other.runner) is GraphRunner and other.runner.mode == "eager" and other.attention.name == "torch"
    assert [s.output_token_ids for s in other.generate(prompts, sp)] == ref
    for module in (engine_module, lesson16_engine, lesson16_runner):
        monkeypatch.setattr(module, "compile_works", lambda: False)
    engine = build_engine(tiny, _config(tiny))
    assert type(engine.runner) is GraphRunner and engine.runner.mode == "eager"
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
    assert sum(engine.runner.replays.values()) > 0


@needs_kernel
def test_bf16_engine_fuses_and_gives_the_tokens_of_the_unfused_one(monkeypatch, tiny_qwen3_dir):
    if not can_pack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing on this CPU")
    model = load_model(tiny_qwen3_dir, torch.bfloat16)
    prompts = _prompts(model, (3, 40, 17, 9))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bpb = KVPool.bytes_per_block(model.config, 4, torch.bfloat16)
    cfg = PagedSchedulerConfig(block_size=4, kv_cache_bytes=60 * bpb, max_num_seqs=4, max_num_batched_tokens=16)
    with monkeypatch.context() as m:
        m.setattr(engine_module, "fuse_projections", lambda model, kernels=False: model)
        unfused = build_engine(model, cfg)
        ref = [s.output_token_ids for s in unfused.generate(prompts, sp)]
    engine = build_engine(model, cfg)
    assert count_fused(unfused.model) == 0 and count_fused(engine.model) == 2 * model.config.num_layers
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref


def test_bf16_smollm2_through_the_fast_paths_says_what_eager_says(smol_dir, smol_tokenizer):
    """The embedded SmolLM2 in bf16 (head_dim 64, 3 query heads a KV head): fused projections,
    elementwise.cpp and the AMX prompt kernel where this CPU has them, prompts split in chunks.
    bf16 paths round differently, so only text the model is sure of is compared with lesson 14's
    eager bf16 engine: three tokens (the fourth of the count is a near tie that lessons 14 and 15
    already pick differently on rounding alone)."""
    from step16_cuda_graph.cpu import ops
    prompts = [smol_tokenizer.encode(t) for t in ("The capital of France is",
                                                  "One, two, three, four, five, six, seven, eight,")]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def config(model):
        return PagedSchedulerConfig(kv_cache_bytes=64 * KVPool.bytes_per_block(model.config, 16, torch.bfloat16),
                                    max_num_seqs=2, max_num_batched_tokens=8)
    model = load_model(smol_dir, torch.bfloat16)
    want = [s.output_token_ids for s in BatchedEngine(model, config(model)).generate(prompts, sp)]
    engine = build_engine(model, config(model))
    if type(engine.runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here")
    packs = can_pack(torch.bfloat16)
    assert count_fused(engine.model) == (2 * model.config.num_layers if packs else 0)
    kernels = ops.elementwise_library() is not None and packs
    assert all(getattr(layer.mlp, "kernels", False) == kernels for layer in engine.model.model.layers)
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == want


@needs_kernel
def test_untied_checkpoint_runs_with_its_head_packed(tmp_path):
    """An untied model's lm_head is a linear like the others: packing it (lesson 14) and routing it
    (this lesson) must leave the engines able to compute logits, with lesson 14's tokens."""
    from minivllm_support.tiny import build_tiny_qwen3
    model = load_model(build_tiny_qwen3(tmp_path / "untied", tie_word_embeddings=False), torch.float32)
    assert model.lm_head is not None
    prompts = _prompts(model, (3, 40, 9))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = _config(model, blocks=30)
    ref = [s.output_token_ids for s in BatchedEngine(model, config, pack_weights=False).generate(prompts, sp)]
    assert [s.output_token_ids for s in build_engine(model, config).generate(prompts, sp)] == ref
