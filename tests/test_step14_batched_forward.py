import pytest
import torch

from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.kv_pool import KVPool, PagedAttention
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.attention import VarlenPagedAttention
from step14_batched_forward.engine import BatchedEngine
from step14_batched_forward.kv_pool import HeadMajorKVPool


def _engine(model, blocks=400, **kw) -> BatchedEngine:
    bpb = KVPool.bytes_per_block(model.config, 16, model.model.embed_tokens.weight.dtype)
    return BatchedEngine(model, PagedSchedulerConfig(kv_cache_bytes=blocks * bpb, **kw))


def test_batched_equals_naive(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    engine = _engine(smol_fp32, max_num_seqs=6, max_num_batched_tokens=512)
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref
    again = engine.generate(prompts, params)               # now with prefix-cache hits
    assert [s.output_token_ids for s in again] == ref
    st = engine.stats()
    assert st.prefix_cache_hits > 0 and st.kv_blocks_used == 0 and st.num_running == st.num_waiting == 0
    assert st.generation_tokens == 2 * sum(len(r) for r in ref)


def test_batched_under_preemption_and_chunking(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    need = max(-(-(len(p) + sp.max_tokens) // 16) for p, sp in zip(prompts, params))
    engine = _engine(smol_fp32, blocks=need + 1, max_num_seqs=6, max_num_batched_tokens=20)
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("chunks", [[1, 1, 1], [5, 1, 9, 1], [7, 16, 3]])
def test_varlen_backend_equals_per_sequence_backend(tiny_qwen3_dir, chunks, use_kernel):
    """Same pool contents, same queries: lesson 14's one-shot attention = lesson 12's loop."""
    from step04_transformer.config import ModelConfig
    cfg = ModelConfig.from_pretrained(tiny_qwen3_dir)
    g = torch.Generator().manual_seed(0)
    pools = [KVPool(cfg, 32, 4, torch.float32), HeadMajorKVPool(cfg, 32, 4, torch.float32)]
    batch, free = ScheduledBatch(), list(range(32))
    for i, n in enumerate(chunks):
        seq = Sequence([1] * (3 * i + n + 2), SamplingParams())
        seq.num_computed_tokens = seq.num_tokens - n          # earlier tokens already cached
        seq.block_table = [free.pop(int(torch.randint(len(free), (1,), generator=g))) for _ in range(-(-seq.num_tokens // 4))]
        batch.add(seq, n)
    all_slots = torch.arange(32 * 4)
    for layer in range(cfg.num_layers):           # the same random K/V in every slot of both layouts
        kk = torch.randn(32 * 4, cfg.num_kv_heads, cfg.head_dim, generator=g)
        vv = torch.randn(32 * 4, cfg.num_kv_heads, cfg.head_dim, generator=g)
        for pool in pools:
            pool.write(layer, all_slots, kk, vv)
    T = sum(chunks)
    q = torch.randn(T, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, generator=g)
    ref = PagedAttention(pools[0], batch)(1, q, k, v)
    out = VarlenPagedAttention(pools[1], batch, use_kernel=use_kernel)(1, q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for seq in batch.seqs:                          # the same slots were written
        table = torch.tensor(seq.block_table)
        for a, b in zip(pools[0].gather(1, table, seq.num_tokens), pools[1].gather(1, table, seq.num_tokens)):
            torch.testing.assert_close(a, b)


def test_seeded_sampling_independent_of_batch(smol_fp32, engine_workload):
    prompts = engine_workload[0]
    sp = SamplingParams(temperature=0.7, top_k=40, max_tokens=10, seed=3, ignore_eos=True)
    from step07_kv_cache.generate import generate_cached
    ref = generate_cached(smol_fp32, prompts[2], sp).token_ids
    engine = _engine(smol_fp32, max_num_seqs=4, max_num_batched_tokens=64)
    noise = SamplingParams(temperature=1.0, max_tokens=7, seed=9)
    out = engine.generate([prompts[0], prompts[2], prompts[4]], [noise, sp, noise])
    assert out[1].output_token_ids == ref
