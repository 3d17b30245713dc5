"""Advanced lesson 05: the radix cache matches at token granularity, copies shared blocks before
writing into them, never leaks or evicts a referenced block (property tests against a model of
the pool's contents), and its engines produce lesson 13's tokens while reusing more of the prompt."""
from __future__ import annotations

import pytest
import torch

from advanced.adv05_radix_cache.block_manager import RadixBlockManager
from advanced.adv05_radix_cache.engine import RadixEngine, build_radix_engine, copy_blocks
from advanced.adv05_radix_cache.radix_tree import RadixTree
from minivllm_support.models import chat_prompt_ids
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.runner import GraphRunner
from step16_cuda_graph.cpu import engine as fast_path


# ---- the pieces, by hand ---------------------------------------------------------------------
def _computed(bm: RadixBlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, SamplingParams())
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_sequence(seq)
    return seq


def test_match_is_token_granular_and_copies_before_writing():
    bm = RadixBlockManager(num_blocks=8, block_size=4)
    a = _computed(bm, [1, 2, 3, 4, 5, 6, 7])
    b = Sequence([1, 2, 3, 4, 5, 6, 9, 9], SamplingParams())
    assert bm.match_prefix(b) == 6 and b.block_table == a.block_table       # lesson 13 would stop at 4
    assert bm.needs_copy(b)                               # a's token 7 sits where b writes 9
    bm.allocate(b, 8)
    assert bm.take_copies() == [(a.block_table[1], b.block_table[1])] and b.block_table[0] == a.block_table[0] != b.block_table[1]
    assert bm.blocks[a.block_table[1]].ref_count == 1


def test_fork_shares_every_block_and_the_first_writer_copies():
    bm = RadixBlockManager(num_blocks=8, block_size=4)
    parent = _computed(bm, [1, 2, 3, 4, 5, 6])
    child = Sequence(parent.prompt_token_ids, parent.params)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    child.token_ids.append(8)
    bm.allocate(child, 7)                                 # shared partial block: copy first
    parent.token_ids.append(7)
    bm.allocate(parent, 7)                                # now its own again: in place
    assert len(bm.take_copies()) == 1 and parent.block_table[1] != child.block_table[1] and parent.block_table[0] == child.block_table[0]
    with pytest.raises(ValueError, match="parent"):
        bm.fork(Sequence([1], SamplingParams()), Sequence([1], SamplingParams()))


def test_lru_leaf_is_evicted_first_and_referenced_blocks_never():
    bm = RadixBlockManager(num_blocks=4, block_size=2)
    old, new = _computed(bm, [1, 1, 1]), _computed(bm, [2, 2, 2])
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and not bm.free_block_ids      # all four cached, all room
    bm.tree.match_prefix([1, 1])                         # touched: [2, 2, 2] is now the LRU leaf
    bm.allocate(Sequence([7], SamplingParams()), 1)      # needs one block: evicts that leaf
    assert bm.tree.match_prefix([2, 2, 2]).num_tokens == 0 and bm.tree.match_prefix([1, 1, 1]).num_tokens == 3
    held = Sequence([1, 1, 1, 5], SamplingParams())
    assert bm.match_prefix(held) == 3
    assert bm.evict(4) == 0                              # nothing cached is left to give
    assert bm.tree.match_prefix([1, 1, 1]).num_tokens == 3 and bm.num_evicted_blocks == 2
    assert all(bm.blocks[b].ref_count == 1 for b in held.block_table) and not set(held.block_table) & set(bm.free_block_ids)
    with pytest.raises(ValueError, match="block_ids"):
        RadixTree(4).insert([1, 2, 3, 4, 5], [0])


@pytest.mark.parametrize("pool_class", [KVPool, HeadMajorKVPool])
def test_copy_blocks_moves_whole_blocks_in_order(pool_class, tiny_qwen3_dir):
    from step04_transformer.config import ModelConfig
    pool = pool_class(ModelConfig.from_pretrained(tiny_qwen3_dir), 4, 4, torch.float32)
    for cache in pool.k + pool.v:
        for b in range(4):
            cache[b] = b
    copy_blocks(pool, [(1, 2), (3, 1)])                  # 2 gets 1's old contents, then 1 gets 3's
    assert all(cache[2].eq(1).all() and cache[1].eq(3).all() for cache in pool.k + pool.v)


# ---- engines --------------------------------------------------------------------------------
SYSTEM = "You are a concise assistant for a small bakery in Lyon. Answer in one short sentence."




def _config(model, block_size=16, blocks=200, **kw):
    bpb = KVPool.bytes_per_block(model.config, block_size, model.model.embed_tokens.weight.dtype)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 512)
    return PagedSchedulerConfig(block_size=block_size, kv_cache_bytes=blocks * bpb, **kw)


def plain(model, config, **kw):
    """Lesson 15's engine (lesson 13's block hashing) on the model's own linears, every step eager."""
    return lesson16.build_engine(model, config, use_graph=False, pack_weights=False, **kw)


def radix(model, config, **kw):
    """The same engine with the radix cache."""
    return build_radix_engine(model, config, fast_path=False, use_graph=False, pack_weights=False, **kw)


def staggered(engine, prompts, params):
    """One arrival per engine step: each request can reuse what the earlier ones computed,
    while they are still running (and writing into the blocks it shares)."""
    seqs = []
    for p in prompts:
        seqs.append(engine.add_request(p, params))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs]


def test_equals_lesson13_and_reuses_more(smol_fp32, smol_tokenizer, one_thread):
    questions = ["Do you sell bread?", "Do you sell cakes?", "Do you sell bread on Sunday?", "Do you sell coffee?"]
    prompts = [chat_prompt_ids(smol_tokenizer, q, system=SYSTEM) for q in questions]
    shared = next(i for i in range(len(prompts[0])) if prompts[0][i] != prompts[1][i])
    assert shared % 16, "the shared prefix must end inside a block"
    sp = SamplingParams(temperature=0, max_tokens=8)
    lesson13 = plain(smol_fp32, _config(smol_fp32))
    engine = radix(smol_fp32, _config(smol_fp32))
    assert type(engine) is RadixEngine
    assert staggered(engine, prompts, sp) == staggered(lesson13, prompts, sp)
    r, h = engine.scheduler.block_manager, lesson13.scheduler.block_manager
    assert r.hit_tokens > h.hit_tokens and r.hit_tokens >= 3 * shared
    assert r.num_copies >= 3                             # every later request copied its mid-block


def test_forked_conversation_keeps_both_branches(smol_fp32, smol_tokenizer, one_thread):
    prompt = chat_prompt_ids(smol_tokenizer, "Name a fruit.", system=SYSTEM)
    assert len(prompt) % 16, "the fork point must be inside a block"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = radix(smol_fp32, _config(smol_fp32))
    parent = engine.add_request(prompt, sp)
    engine.step()                                          # prefill; parent holds 1 sampled token
    alt = smol_tokenizer.encode(" Banana", add_special_tokens=False)[0]
    assert alt != parent.token_ids[-1]
    child = engine.fork(parent, next_token=alt)            # both write position len(prompt) next
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.block_manager.num_copies == 1
    ref = plain(smol_fp32, _config(smol_fp32))
    rest = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)   # alt is the child's first
    want = ref.generate([prompt, prompt + [alt]], [sp, rest])
    assert parent.output_token_ids == want[0].output_token_ids
    assert child.output_token_ids == [alt] + want[1].output_token_ids
    with pytest.raises(ValueError, match="parent"):
        engine.fork(parent)                                # finished: nothing to share


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, torch.float32)


def test_fast_path_engine_under_preemption_equals_lesson13(tiny, one_thread):
    """Lesson 16's fast-path engine without graphs (packed, fused projections), with and without the radix cache."""
    g = torch.Generator().manual_seed(3)
    stem = torch.randint(5, tiny.config.vocab_size, (21,), generator=g).tolist()
    prompts = [stem[:n] + torch.randint(5, tiny.config.vocab_size, (m,), generator=g).tolist()
               for n, m in ((21, 6), (14, 9), (21, 3), (7, 20), (18, 5), (21, 11))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    config = _config(tiny, block_size=4, blocks=18, max_num_batched_tokens=24)
    ref = staggered(fast_path.build_engine(tiny, config, use_graph=False), prompts, sp)
    engine = build_radix_engine(tiny, config, use_graph=False)
    assert staggered(engine, prompts, sp) == ref
    stats, bm = engine.stats(), engine.scheduler.block_manager
    assert engine.scheduler.num_preemptions > 0 and bm.num_copies > 0
    assert stats.prefix_cache_hits == bm.hit_tokens > 0 and stats.kv_blocks_used == 0
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(stem * 3, SamplingParams(max_tokens=10))   # 73 tokens: 19 blocks > 18


def test_recorded_decode_steps_copy_before_the_replay(tiny, one_thread):
    """Lesson 16's runner: decode steps replay a recorded step, and the copies a fork queues are
    made before it (prepare_kv runs before the runner, whatever the runner)."""
    prompt = torch.randint(5, tiny.config.vocab_size, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = _config(tiny, block_size=4, blocks=24)
    engine = build_radix_engine(tiny, config, fast_path=False, pack_weights=False, record_now=False)
    assert isinstance(engine.runner, GraphRunner)
    parent = engine.add_request(prompt, sp)
    engine.step()                                          # prefill: position 10 is inside a block
    alt = (parent.token_ids[-1] + 1) % tiny.config.vocab_size
    child = engine.fork(parent, next_token=alt)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.block_manager.num_copies == 1 and sum(engine.runner.replays.values()) > 0
    want = plain(tiny, config).generate([prompt, prompt + [alt]], [sp, SamplingParams(temperature=0, max_tokens=7,
                                                                                       ignore_eos=True)])
    assert parent.output_token_ids == want[0].output_token_ids
    assert child.output_token_ids == [alt] + want[1].output_token_ids


def test_needs_the_radix_parts(tiny):
    with pytest.raises(TypeError, match="RadixScheduler"):
        lesson16.build_engine(tiny, _config(tiny), use_graph=False, engine_class=RadixEngine)
    with pytest.raises(TypeError, match="fast_path must be True or False"):
        build_radix_engine(tiny, _config(tiny), fast_path=13)
