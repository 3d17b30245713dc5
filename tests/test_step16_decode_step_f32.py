"""Lesson 16, part 2, in float32: the one-call decode step over gemm_f32's panels (x86 builds
with AVX2 + FMA: a CPU without bf16 arithmetic, or baseline mode). Against the compiled path it
replaces: the same tokens through preemption, hidden states equal to float32 rounding, for both
kinds of panels (float32 values; bf16 values kept as bf16), and the buckets it takes."""
from __future__ import annotations

import pytest
import torch

from step04_transformer.loader import load_model
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu import decode_step
from step16_cuda_graph.cpu.engine import build_engine
from step16_cuda_graph.cpu.ops import OpPackedLinear, gemm_f32_rows
from step16_cuda_graph.cpu.runner import CpuGraphRunner
from minivllm_support.tiny import build_tiny_qwen3
from tests.test_step16_decode_step import same_tokens_through_preemption

pytestmark = pytest.mark.skipif(not decode_step.has_loop(torch.float32) or gemm_f32_rows() < 1,
                                reason="the float32 one-call decode step needs gemm_f32 (an x86 build with AVX2 + FMA)")


@pytest.fixture(scope="module", params=["float32 values", "bf16 values"])
def model(request, tmp_path_factory):
    """A tiny Qwen3 (q/k norms, two query heads a KV head) in float32; its weights either
    float32 values (float32 panels) or bf16 values (panels kept as bf16)."""
    folder = build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-f32"), head_dim=32, num_hidden_layers=3)
    dtype = torch.float32 if request.param == "float32 values" else torch.bfloat16
    return load_model(folder, dtype).float()


@pytest.fixture(scope="module")
def pair(model):
    """The one-call engine and the compiled one, buckets 1, 2, 4, 8, a pool of 16 blocks of 4."""
    config = lambda: PagedSchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                                          kv_cache_bytes=16 * KVPool.bytes_per_block(model.config, 4, torch.float32))
    one, compiled = (build_engine(model, config(), one_call=flag) for flag in (True, False))
    if type(one.runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here")
    return one, compiled


def test_small_buckets_are_one_call_over_the_panels(pair, model):
    one, compiled = pair
    assert sorted(one.runner.one_call_steps) == [1, 2, 4] and set(one.runner.direct) == {8}
    assert compiled.runner.one_call_steps == {} and set(compiled.runner.direct) == {1, 2, 4, 8}
    linears = [m for m in one.model.modules() if type(m) is OpPackedLinear]
    want = torch.bfloat16 if torch.equal(model.model.layers[0].mlp.down_proj.weight.bfloat16().float(),
                                         model.model.layers[0].mlp.down_proj.weight) else torch.float32
    assert linears and all(m.panels is not None and m.panels.dtype == want for m in linears)


def test_one_call_gives_the_compiled_tokens_through_preemption(pair, model):
    same_tokens_through_preemption(*pair, model)


def test_one_call_gives_the_compiled_steps_hidden_states(pair):
    """The same static step through both, on the same pool contents: the same hidden states up
    to float32 rounding (the C passes sum in another order than inductor's code)."""
    one, compiled = pair
    with torch.inference_mode():
        for layer in range(len(one.kv_pool.k)):
            for pool in (one.kv_pool, compiled.kv_pool):     # the same random contents in both
                g = torch.Generator().manual_seed(layer)
                pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=g))
                pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=g))
        for b in (1, 2, 4):
            for engine in (one, compiled):
                s = engine.runner.static
                s.input_ids[:b] = torch.randint(5, 500, (b,), generator=torch.Generator().manual_seed(b))
                s.positions[:b] = torch.arange(4, 4 + b)      # all in the second block
                s.seq_lens[:b] = s.positions[:b] + 1
                s.block_tables[:b, :2] = torch.arange(2 * b).view(b, 2)
                engine.runner.set_slots(s.block_tables[:b, 1] * 4 + s.positions[:b] - 4, b)
            got, want = one.runner.decode(b), compiled.runner.decode(b)
            assert got.dtype == torch.float32 and got.abs().sum() > 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_it_does_not_take_keeps_the_compiled_path(model):
    """The option off, or a layer of another type: no plan."""
    config = PagedSchedulerConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                                  kv_cache_bytes=16 * KVPool.bytes_per_block(model.config, 4, torch.float32))
    assert build_engine(model, config, one_call=False, record_now=False).runner.one_call is False
    fast = build_engine(model, config, record_now=False).model
    assert decode_step.fits(fast)
    layer = fast.model.layers[1]
    layer.__class__ = type("OtherLayer", (type(layer),), {})
    assert not decode_step.fits(fast)
