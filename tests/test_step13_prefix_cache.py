import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm_support.models import chat_prompt_ids
from step06_sampler.params import SamplingParams
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from step13_prefix_cache.engine import PrefixCachingEngine
from step05_naive.generate import generate_naive
from tests.test_step12_paged_attention import check_invariants, run_random_ops

SYSTEM = ("You are a concise assistant for a small bakery in Lyon. Answer in one short sentence. "
          "We open at 7am and close at 6pm, every day except Monday.")


def _engine(model, blocks=400, **kw) -> PrefixCachingEngine:
    bpb = KVPool.bytes_per_block(model.config, 16, model.model.embed_tokens.weight.dtype)
    kw.setdefault("max_num_batched_tokens", 512)
    return PrefixCachingEngine(model, PagedSchedulerConfig(kv_cache_bytes=blocks * bpb, **kw))


def _reference(model, prompts, max_tokens):
    return [generate_naive(model, p, max_tokens, model.config.eos_token_ids).token_ids for p in prompts]


def test_prefix_cached_equals_naive(smol_fp32, engine_workload):
    prompts, params, ref = engine_workload
    engine = _engine(smol_fp32, max_num_seqs=2)
    assert [s.output_token_ids for s in engine.generate(prompts, params)] == ref
    again = engine.generate(prompts, params)             # second pass: the chat template prefix hits
    assert [s.output_token_ids for s in again] == ref
    assert engine.scheduler.block_manager.hit_tokens > 0


@pytest.mark.slow      # ~6 s; make test keeps the other prefix-cache equalities
def test_shared_system_prompt_hits(smol_fp32, smol_tokenizer):
    prompts = [chat_prompt_ids(smol_tokenizer, q, system=SYSTEM) for q in
               ("When do you open?", "Are you open on Monday?", "Do you sell bread?")]
    ref = _reference(smol_fp32, prompts, 10)
    engine = _engine(smol_fp32, max_num_seqs=1)           # one at a time: each later request hits
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert [s.output_token_ids for s in out] == ref
    bm = engine.scheduler.block_manager
    shared = min(len(p) for p in prompts) // 16 * 16
    assert bm.hit_tokens >= 2 * (shared - 16)


def test_prompt_entirely_cached_recomputes_last_token(smol_fp32, smol_tokenizer):
    # A prompt of exactly 3 full blocks, sent twice: the second time every block is cached, yet
    # the last block must be computed again to get logits for the first new token.
    ids = (chat_prompt_ids(smol_tokenizer, "Tell me about bread. " * 10))[:48]
    ref = _reference(smol_fp32, [ids], 8)[0]
    engine = _engine(smol_fp32, max_num_seqs=1)
    first = engine.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0]
    second = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    assert engine.scheduler.block_manager.hit_tokens == 32   # 2 of 3 blocks reused, 1 recomputed
    while engine.has_unfinished():
        engine.step()
    assert first.output_token_ids == second.output_token_ids == ref


@pytest.mark.slow      # ~6 s; make test keeps the other prefix-cache equalities
def test_same_prefix_admitted_in_the_same_step(smol_fp32, smol_tokenizer):
    prompts = [chat_prompt_ids(smol_tokenizer, q, system=SYSTEM) for q in ("Hi!", "Hello!", "Hi!")]
    ref = _reference(smol_fp32, prompts, 8)
    engine = _engine(smol_fp32, max_num_seqs=8)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [s.output_token_ids for s in out] == ref
    # All three were prefilled together: nothing was reusable yet (blocks are only cached once
    # their K/V are computed), but the next request finds the prefix.
    bm = engine.scheduler.block_manager
    assert bm.hit_tokens == 0
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
    assert bm.hit_tokens > 0
    check_invariants(bm, [])


@pytest.mark.slow
def test_preempting_a_sequence_that_holds_shared_blocks(smol_fp32, smol_tokenizer):
    prompts = [chat_prompt_ids(smol_tokenizer, q, system=SYSTEM) for q in
               ("When do you open?", "Do you sell croissants?", "Where are you?", "Are you open on Monday?")]
    ref = _reference(smol_fp32, prompts, 16)
    need = max(-(-(len(p) + 16) // 16) for p in prompts)
    engine = _engine(smol_fp32, blocks=need + 2, max_num_seqs=4, max_num_batched_tokens=64)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))   # warm the prefix
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.block_manager.hit_tokens > 0
    ref_ignore = [generate_naive(smol_fp32, p, 16, ignore_eos=True).token_ids for p in prompts]
    assert [s.output_token_ids for s in out] == ref_ignore
    check_invariants(engine.scheduler.block_manager, [])


def test_freed_blocks_are_reused_then_evicted_lru():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3, 4, 5], SamplingParams())
    bm.match_prefix(a)
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)                                            # 2 full blocks stay cached while free
    b = Sequence([1, 2, 3, 4, 9], SamplingParams())
    assert bm.match_prefix(b) == 4 and b.block_table == a_blocks(bm, [1, 2, 3, 4])
    bm.free(b)
    c = Sequence([7, 7, 7, 7, 7, 7, 7, 7], SamplingParams())   # needs all 4 blocks: evicts the cache
    bm.match_prefix(c)
    bm.allocate(c, 8)
    assert not bm.cached
    bm.free(c)
    check_invariants(bm, [])


def a_blocks(bm, tokens):
    from step13_prefix_cache.block_manager import block_hash
    prev, out = None, []
    for i in range(0, len(tokens), bm.block_size):
        prev = block_hash(prev, tuple(tokens[i:i + bm.block_size]))
        out.append(bm.cached[prev])
    return out


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_prefix_block_manager_properties(data):
    # 50 examples x 220 operations, with a tiny vocabulary so that prefixes really repeat
    bm = PrefixCachingBlockManager(num_blocks=data.draw(st.integers(4, 40)), block_size=data.draw(st.sampled_from([1, 2, 4])))
    run_random_ops(bm, data, 220, vocab=2, match_prefix=bm.match_prefix, cache=bm.cache_full_blocks)
    assert all(bm.hash_of[b] == h for h, b in bm.cached.items())
