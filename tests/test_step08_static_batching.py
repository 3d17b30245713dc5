import pytest

from step06_sampler.params import SamplingParams
from step07_kv_cache.generate import generate_cached
from step08_static_batching.batch import generate_static


def test_batch_equals_naive_per_request(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    outs, stats = generate_static(smol_fp32, prompts, params, smol_fp32.config.eos_token_ids)
    assert [o.token_ids for o in outs] == ref
    assert 0 < stats.useful < stats.slots   # mixed lengths: some slots are always wasted


def test_seeded_request_same_alone_or_batched(smol_fp32, engine_workload):
    prompts = engine_workload[0]
    sp = SamplingParams(temperature=1.0, top_k=50, max_tokens=10, seed=7, ignore_eos=True)
    alone = generate_cached(smol_fp32, prompts[2], sp).token_ids
    others = SamplingParams(temperature=0.7, max_tokens=6, seed=1)
    outs, _ = generate_static(smol_fp32, [prompts[0], prompts[2], prompts[5]], [others, sp, others])
    assert outs[1].token_ids == alone


def test_bad_batches_error(smol_fp32):
    with pytest.raises(ValueError, match="no prompts"):
        generate_static(smol_fp32, [], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        generate_static(smol_fp32, [[1, 2], []], SamplingParams())
