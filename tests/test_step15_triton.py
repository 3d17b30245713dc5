"""Lesson 15's Triton kernels, run on the CPU by Triton's interpreter, against float32 attention.

TRITON_INTERPRET must be set before `@triton.jit` runs, so it is set here, at import, and the
kernels are imported at collection time (before any test of another file imports them).
On a machine with a GPU, `TRITON_INTERPRET=0 pytest tests/test_step15_triton.py` runs the same
tests on the GPU: the kernels compiled, the cases moved to CUDA, the reference still on the CPU.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from step15_flash_attention.reference import random_paged_case, reference_attention  # noqa: E402
from step15_flash_attention.triton_attention import flash_attention_triton  # noqa: E402

# Only an explicit TRITON_INTERPRET=0 with a GPU present leaves the interpreter (CI: unset, so CPU).
DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"


def on_device(case: tuple) -> tuple:
    return tuple(t.to(DEVICE) for t in case)


CASES = [
    ([1, 1, 1], [1, 16, 83]),                      # decodes only: one key, a full block, many blocks
    ([33], [33]),                                  # one whole prompt, partial last block
    ([1, 20, 5, 1], [9, 20, 37, 64]),              # mixed: decodes, a prompt, a chunk after prior context
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Hkv, group, bs, D", [(2, 2, 16, 64), (1, 4, 4, 64), (1, 1, 32, 128), (1, 3, 5, 64)])
def test_triton_equals_reference(dtype, tol, Hkv, group, bs, D):
    for i, (q_lens, seq_lens) in enumerate(CASES):
        case = random_paged_case(q_lens, seq_lens, Hkv, group, bs, D, dtype, seed=i)
        out = flash_attention_triton(*on_device(case))
        assert out.dtype == dtype and out.shape == case[0].shape and out.device.type == DEVICE
        torch.testing.assert_close(out.float().cpu(), reference_attention(*case), atol=tol, rtol=tol)


def test_triton_never_reads_keys_past_the_length():
    bs = 4
    q, k_pool, v_pool, cu, lens, tables = case = random_paged_case([1, 6, 3], [6, 9, 11], 2, 2, bs, 64, spare_blocks=4)
    out = flash_attention_triton(*on_device(case))
    k2, v2, used = k_pool.clone(), v_pool.clone(), set()
    for b, n in enumerate(lens.tolist()):
        last = int(tables[b, (n - 1) // bs])
        k2[last, :, (n - 1) % bs + 1:], v2[last, :, (n - 1) % bs + 1:] = float("nan"), float("nan")
        used.update(tables[b, :(n - 1) // bs + 1].tolist())
    for blk in set(range(k_pool.shape[0])) - used:
        k2[blk], v2[blk] = float("nan"), float("nan")
    torch.testing.assert_close(flash_attention_triton(*on_device((q, k2, v2, cu, lens, tables))), out)


def test_triton_rejects_bad_input():
    q, k_pool, v_pool, cu, lens, tables = on_device(random_paged_case([3, 1], [5, 9], 2, 2, 4, 64))
    with pytest.raises(TypeError, match="dtype"):
        flash_attention_triton(q, k_pool.bfloat16(), v_pool, cu, lens, tables)
    with pytest.raises(ValueError, match="outside the pool"):
        flash_attention_triton(q, k_pool, v_pool, cu, lens, tables.clone().fill_(99))
    with pytest.raises(ValueError, match="capacity"):
        flash_attention_triton(q, k_pool, v_pool, cu, torch.tensor([5, 99], device=DEVICE), tables)
    q48, kp48, vp48, *_ = on_device(random_paged_case([3, 1], [5, 9], 2, 2, 4, 48))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        flash_attention_triton(q48, kp48, vp48, cu, lens, tables)


def test_engine_with_the_triton_backend_equals_lesson14(tiny_qwen3_dir):
    from step04_transformer.loader import load_model
    from step06_sampler.params import SamplingParams
    from step12_paged_attention.kv_pool import KVPool
    from step12_paged_attention.scheduler import PagedSchedulerConfig
    from step14_batched_forward.engine import BatchedEngine
    from step15_flash_attention.engine import build_engine
    model = load_model(tiny_qwen3_dir, torch.float32)
    prompts = [[5, 9, 14, 200, 31], list(range(40, 75)), [7]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    config = PagedSchedulerConfig(block_size=8, kv_cache_bytes=32 * KVPool.bytes_per_block(model.config, 8, torch.float32),
                                  max_num_seqs=3, max_num_batched_tokens=16)
    ref = [s.output_token_ids for s in BatchedEngine(model, config, pack_weights=False).generate(prompts, sp)]
    engine = build_engine(model.to(DEVICE), config, attention_backend="triton")   # pool and metadata follow
    assert engine.attention.name == "triton"
    assert [s.output_token_ids for s in engine.generate(prompts, sp)] == ref
