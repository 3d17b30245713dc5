import torch

from step06_sampler.params import SamplingParams
from step07_kv_cache.generate import generate_cached
from step07_kv_cache.kv_cache import KVCache


def test_greedy_equals_naive(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    for p, sp, r in zip(prompts, params, ref):
        assert generate_cached(smol_fp32, p, sp, smol_fp32.config.eos_token_ids).token_ids == r


def test_cache_grows_and_keeps_contents(tiny_qwen3_dir):
    from step04_transformer.config import ModelConfig
    cfg = ModelConfig.from_pretrained(tiny_qwen3_dir)
    cache = KVCache(cfg, 2, torch.float32)
    k = torch.randn(2, cfg.num_kv_heads, cfg.head_dim)
    cache.write(0, 0, k, k)
    cache.length = 2
    cache.reserve(5)
    assert cache.capacity >= 5
    torch.testing.assert_close(cache.keys_values(0, 2)[0], k)


def test_seeded_sampling_is_reproducible(smol_fp32, engine_workload):
    prompts = engine_workload[0]
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    a = generate_cached(smol_fp32, prompts[1], sp).token_ids
    assert a == generate_cached(smol_fp32, prompts[1], sp).token_ids
