import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from step06_sampler.params import SamplingParams
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.block_manager import BlockManager
from step12_paged_attention.engine import PagedEngine
from step12_paged_attention.kv_pool import KVPool, slot_mapping
from step12_paged_attention.scheduler import PagedSchedulerConfig


def _config(model, blocks: int, **kw) -> PagedSchedulerConfig:
    bpb = KVPool.bytes_per_block(model.config, 16, model.model.embed_tokens.weight.dtype)
    return PagedSchedulerConfig(kv_cache_bytes=blocks * bpb, **kw)


def test_paged_equals_naive(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    engine = PagedEngine(smol_fp32, _config(smol_fp32, 200, max_num_seqs=4, max_num_batched_tokens=512))
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks          # everything returned


def test_paged_under_preemption_and_chunking(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    need = max(-(-(len(p) + sp.max_tokens) // 16) for p, sp in zip(prompts, params))
    engine = PagedEngine(smol_fp32, _config(smol_fp32, need + 1, max_num_seqs=6, max_num_batched_tokens=24))
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref
    assert engine.scheduler.num_preemptions > 0


def test_impossible_request_rejected(smol_fp32):
    engine = PagedEngine(smol_fp32, _config(smol_fp32, 2))
    with pytest.raises(ValueError, match="could never finish"):
        engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=4))


def test_slot_mapping():
    # positions 14..17 with block_size 4: blocks 3 and 4 of the table
    assert slot_mapping([3, 0, 6, 5, 1], 14, 18, 4) == [5 * 4 + 2, 5 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1]


def test_pool_write_and_gather_roundtrip(tiny_qwen3_dir):
    from step04_transformer.config import ModelConfig
    cfg = ModelConfig.from_pretrained(tiny_qwen3_dir)
    pool = KVPool(cfg, num_blocks=6, block_size=4, dtype=torch.float32)
    table = [4, 1, 3]
    k = torch.randn(10, cfg.num_kv_heads, cfg.head_dim)
    pool.write(0, torch.tensor(slot_mapping(table, 0, 10, 4)), k, -k)
    gk, gv = pool.gather(0, torch.tensor(table), 10)
    torch.testing.assert_close(gk, k)
    torch.testing.assert_close(gv, -k)


def test_pool_from_budget():
    from step04_transformer.config import ModelConfig
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                 "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "head_dim": 4})
    per_block = KVPool.bytes_per_block(cfg, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 1 * 4 * 2
    assert KVPool.from_memory_budget(cfg, 5 * per_block + 7, 16, torch.bfloat16).num_blocks == 5
    with pytest.raises(ValueError, match="less than one block"):
        KVPool.from_memory_budget(cfg, per_block - 1, 16, torch.bfloat16)


def check_invariants(bm: BlockManager, holders: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in holders:
        for b in s.block_table or []:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs                      # ref counts = holders
    free = list(bm.free_block_ids)
    assert len(set(free)) == len(free)                                    # never freed twice
    assert all(refs[b] == 0 for b in free)                                # free blocks unheld
    used = sum(1 for r in refs if r > 0)
    assert used + len(free) == bm.num_blocks                              # nothing leaked


def run_random_ops(bm: BlockManager, data, n_ops: int, vocab: int, match_prefix=None, cache=None) -> None:
    """allocate / append / free / preempt at random, checking the invariants after every op."""
    running: list[Sequence] = []
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(["new", "append", "append", "free", "preempt"]))
        if op == "new":
            n = data.draw(st.integers(1, 40))
            seq = Sequence([data.draw(st.integers(1, vocab)) for _ in range(n)], SamplingParams(max_tokens=64))
            if match_prefix:
                match_prefix(seq)
            want = seq.num_uncomputed_tokens
            if bm.room(seq) >= want:
                bm.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                running.append(seq)
                if cache:
                    cache(seq)
            else:
                bm.free(seq)
        elif op == "append" and running:
            seq = data.draw(st.sampled_from(running))
            k = data.draw(st.integers(1, 20))
            if bm.room(seq) >= k:
                seq.token_ids += [data.draw(st.integers(1, vocab)) for _ in range(k)]
                bm.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                if cache:
                    cache(seq)
        elif op in ("free", "preempt") and running:
            seq = running.pop(data.draw(st.integers(0, len(running) - 1)))
            bm.free(seq)
            if op == "preempt":
                seq.num_computed_tokens = 0
        check_invariants(bm, running)
    for seq in running:
        bm.free(seq)
    check_invariants(bm, [])


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_block_manager_properties(data):
    # 50 examples x 220 operations = 11,000 random operations
    bm = BlockManager(num_blocks=data.draw(st.integers(4, 40)), block_size=data.draw(st.sampled_from([1, 4, 16])))
    run_random_ops(bm, data, 220, vocab=50)
