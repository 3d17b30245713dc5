"""Advanced 01: the file's Q4_1 blocks on our own kernel (q4_1_kernel.py, q4_1_gemv.cpp). The
repacked nibbles give back the file's values bit for bit; the kernel is the float32 product with
them to one bf16 rounding (and, with float32 activations, to float32 sum order), for one to four
rows and more; the model transform stacks q|k|v and gate|up; in lesson 16's fast path the small
buckets run as one C call through the Q4_1 format, in bf16 and in float32, with the tokens of the
same model's compiled layers (slow marker: two engines on SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from advanced.adv01_quantization import q4_1_kernel
from advanced.adv01_quantization.gguf_q4_1 import embedded_gguf, read_q4_1
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu import decode_step
from step16_cuda_graph.cpu.fused import FusedQKVAttention, FusedSwiGLU
from step16_cuda_graph.cpu.runner import CpuGraphRunner

pytestmark = pytest.mark.skipif(q4_1_kernel.load() is None, reason="no C++ compiler for q4_1_gemv.cpp")


@pytest.fixture(scope="module")
def blocks(smol_dir):
    return read_q4_1(embedded_gguf(), 9, 3)[0]


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"])
def test_repacked_blocks_are_the_files_values(blocks, name):
    linear = q4_1_kernel.Q41Linear([blocks[name]])
    assert linear.qs.shape == (linear.out_features, linear.in_features // 32, 16) and linear.qs.dtype == torch.uint8
    assert torch.equal(linear.dequantize(), blocks[name].dequantize())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_kernel_is_the_float32_product_to_one_rounding(blocks, rows):
    """Stacked gate|up (3,072 x 576) and down (576 x 1,536): every output within half a bf16 step
    of the float32 product with the file's values (plus float32 sum order)."""
    g = torch.Generator().manual_seed(rows)
    for parts in (["model.layers.4.mlp.gate_proj", "model.layers.4.mlp.up_proj"], ["model.layers.4.mlp.down_proj"]):
        linear = q4_1_kernel.Q41Linear([blocks[p] for p in parts])
        x = torch.randn(rows, linear.in_features, generator=g).bfloat16()
        want = x.float() @ linear.dequantize().T
        got = linear(x)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        half_step = want.abs() * 2.0 ** -8         # bf16 keeps 8 significant bits: a step is <= |v| 2^-7
        assert ((got.float() - want).abs() <= half_step + 1e-4 * want.abs().max()).all()


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_float32_kernel_is_the_float32_product(blocks, rows):
    """float32 activations in and out (q4_1_linear_f32): the product to float32 sum order."""
    g = torch.Generator().manual_seed(rows)
    linear = q4_1_kernel.Q41Linear([blocks["model.layers.4.mlp.down_proj"]])
    x = torch.randn(rows, linear.in_features, generator=g)
    want = x.double() @ linear.dequantize().double().T
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_transform_stacks_and_keeps_the_rest(smol_dir):
    from step04_transformer.loader import load_model
    model = load_model(smol_dir, torch.bfloat16)
    fast = q4_1_kernel.q4_1_fast_model(model)
    layers = fast.model.layers
    assert all(type(l.self_attn) is FusedQKVAttention and type(l.mlp) is FusedSwiGLU for l in layers)
    assert sum(type(m) is q4_1_kernel.Q41Linear for m in fast.modules()) == 4 * len(layers)
    assert layers[0].self_attn.qkv_proj.out_features == (9 + 2 * 3) * 64
    assert layers[0].mlp.gate_up_proj.out_features == 2 * 1536
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear       # the input is left as it was
    assert type(q4_1_kernel.q4_1_fast_model(model.float()).model.layers[0].mlp.down_proj) is q4_1_kernel.Q41Linear
    with pytest.raises(ValueError, match="bf16 or float32"):
        q4_1_kernel.q4_1_fast_model(model.half())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_call_q4_1_engine_gives_the_compiled_layers_tokens(dtype):
    if not decode_step.has_loop(dtype):
        pytest.skip(f"this build has no one-call decode step in {dtype} (bf16: AVX-512 BF16; float32: AVX2 + FMA)")
    from step04_transformer.loader import load_model
    from minivllm_support.models import embedded_smollm2
    model = q4_1_kernel.q4_1_fast_model(load_model(embedded_smollm2(), torch.bfloat16).to(dtype))
    config = PagedSchedulerConfig(kv_cache_bytes=64 * KVPool.bytes_per_block(model.config, 16, dtype),
                                  max_num_seqs=4, max_num_batched_tokens=32)
    from step16_cuda_graph.cpu.engine import build_engine
    one, compiled = (build_engine(model, config, one_call=flag) for flag in (True, False))
    if type(one.runner) is not CpuGraphRunner:
        pytest.skip("torch.compile does not work here")
    assert sorted(one.runner.one_call_steps) == [1, 2, 4] and compiled.runner.one_call_steps == {}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 40, 3)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [s.output_token_ids for s in one.generate(prompts, sp)] == \
        [s.output_token_ids for s in compiled.generate(prompts, sp)]
    assert sum(one.runner.replays[b] for b in (1, 2, 4)) > 0
