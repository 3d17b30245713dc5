"""Lesson 16, part 2: decode steps of one to four rows as one C call over a recorded plan
(decode_step.py). Against the compiled path it replaces: the same hidden states and tokens (a
Qwen3 with q/k norms, and the embedded SmolLM2 with three query heads a KV head), through
preemption and recompute; the buckets it takes and the ones it leaves; where it does not apply
(the option off, a layer it does not know); and that a dropped engine is still freed. The
float32 loop: test_step16_decode_step_f32.py."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import can_pack
from step16_cuda_graph.cpu import decode_step
from step16_cuda_graph.cpu.engine import build_engine
from step16_cuda_graph.cpu.runner import CpuGraphRunner
from minivllm_support.tiny import build_tiny_qwen3
from tests.test_step16_cuda_graph import _prompts

pytestmark = pytest.mark.skipif(not decode_step.has_loop(torch.bfloat16) or not can_pack(torch.bfloat16),
                                reason="the one-call decode step needs the AVX-512 BF16 build of decode_step.cpp "
                                       "and oneDNN bf16 packing")


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory):
    """A tiny Qwen3 the C loop takes: head_dim 32 (elementwise.cpp's passes), hidden 64."""
    folder = build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-d32"), head_dim=32, num_hidden_layers=3)
    return load_model(folder, torch.bfloat16)


def _config(model, blocks=16, max_num_seqs=8, budget=16):
    return PagedSchedulerConfig(block_size=4, kv_cache_bytes=blocks * KVPool.bytes_per_block(model.config, 4, torch.bfloat16),
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def _engines(model, **config):
    one, compiled = (build_engine(model, _config(model, **config), one_call=flag) for flag in (True, False))
    if type(one.runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here")
    return one, compiled


@pytest.fixture(scope="module")
def pair(qwen3_bf16):
    """The one-call engine and the compiled one, buckets 1, 2, 4, 8, a pool of 16 blocks of 4."""
    return _engines(qwen3_bf16)


def test_small_buckets_are_one_call_and_larger_ones_compiled(pair):
    one, compiled = pair
    assert sorted(one.runner.one_call_steps) == [1, 2, 4] and set(one.runner.direct) == {8}
    assert compiled.runner.one_call_steps == {} and set(compiled.runner.direct) == {1, 2, 4, 8}


def test_one_call_gives_the_compiled_tokens_through_preemption(pair, qwen3_bf16):
    """Greedy tokens of one to four sequences, with prompts chunked and a pool small enough to
    preempt: the one-call engine says what the compiled one says, token for token."""
    same_tokens_through_preemption(*pair, qwen3_bf16)


def same_tokens_through_preemption(one, compiled, model):
    """The check above, for any pair of engines built on `model` (the float32 tests use it)."""
    prompts = _prompts(model, (11, 3, 22, 6))
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    replays = sum(one.runner.replays[b] for b in (1, 2, 4))
    got = [s.output_token_ids for s in one.generate(prompts, sp)]
    want = [s.output_token_ids for s in compiled.generate(prompts, sp)]
    assert got == want
    assert sum(one.runner.replays[b] for b in (1, 2, 4)) > replays
    assert one.scheduler.num_preemptions > 0 and compiled.scheduler.num_preemptions == one.scheduler.num_preemptions


def test_one_call_gives_the_compiled_steps_hidden_states(pair):
    """The same static step (pads included) through both, on the same pool contents: equal
    hidden states, bit for bit, in every bucket it takes."""
    one, compiled = pair
    with torch.inference_mode():
        for layer in range(len(one.kv_pool.k)):
            one.kv_pool.k[layer].copy_(compiled.kv_pool.k[layer])
            one.kv_pool.v[layer].copy_(compiled.kv_pool.v[layer])
        for b in (1, 2, 4):
            for engine in (one, compiled):       # the same step in both: ids, positions, tables, slots
                s = engine.runner.static
                s.input_ids[:b] = torch.arange(7, 7 + b)
                s.positions[:b] = torch.arange(3, 3 + b)
                s.seq_lens[:b] = s.positions[:b] + 1
                s.block_tables[:b, :2] = torch.arange(2 * b).view(b, 2)
                engine.runner.set_slots(s.block_tables[:b, 0] * 4 + s.positions[:b], b)
            got, want = one.runner.decode(b), compiled.runner.decode(b)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_one_call_gives_the_compiled_tokens_on_smollm2(smol_dir):
    """The embedded SmolLM2 (no q/k norms, head_dim 64, three query heads a KV head)."""
    model = load_model(smol_dir, torch.bfloat16)
    one, compiled = _engines(model, max_num_seqs=4)
    prompts = _prompts(model, (11, 3, 22, 6))
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    assert [s.output_token_ids for s in one.generate(prompts, sp)] == \
        [s.output_token_ids for s in compiled.generate(prompts, sp)]
    assert one.scheduler.num_preemptions > 0 and sum(one.runner.replays[b] for b in (1, 2, 4)) > 0


def test_where_it_does_not_apply_the_compiled_path_runs(qwen3_bf16, tiny_qwen3_dir):
    """head_dim 16 (no C element-wise passes in bf16), small_rows off, or a layer of another
    type: no plan."""
    built = lambda model, **kw: build_engine(model, _config(qwen3_bf16), record_now=False, **kw)
    for engine in (built(load_model(tiny_qwen3_dir, torch.bfloat16)),
                   built(qwen3_bf16, small_rows=False), built(qwen3_bf16, one_call=False)):
        assert engine.runner.one_call is False
    model = built(qwen3_bf16).model
    assert decode_step.fits(model)
    layer = model.model.layers[1]
    layer.__class__ = type("OtherLayer", (type(layer),), {})
    assert not decode_step.fits(model)


def test_a_dropped_one_call_engine_is_freed(qwen3_bf16):
    engine = build_engine(qwen3_bf16, _config(qwen3_bf16, max_num_seqs=1))
    assert engine.runner.one_call_steps
    runner, pool = weakref.ref(engine.runner), weakref.ref(engine.kv_pool)
    del engine
    gc.collect()
    assert runner() is None and pool() is None
