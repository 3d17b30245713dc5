"""Advanced lesson 03: speculative decoding gives the non-speculative engine's greedy tokens exactly
(fp32, tiny Qwen3 and the embedded SmolLM2, with both proposers, partial grants and preemption),
rolls the KV pool back after rejections, and stops exactly at max_tokens, EOS and
stop tokens even when several tokens are accepted in one step."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from advanced.adv03_speculative import rejection
from advanced.adv03_speculative.engine import SpecBlockManager, SpecEngine, build_spec_engine
from advanced.adv03_speculative.proposers import Draft, LayerSkipProposer, NgramProposer, prompt_lookup
from advanced.adv03_speculative.rejection import rejection_sample, verify_greedy
from minivllm_support.models import chat_prompt_ids
from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step06_sampler.sampler import exponential_race
from step06_sampler.stats import chi2_critical, frequency_test
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.runner import GraphRunner
from step16_cuda_graph.cpu import engine as fast_path

ALPHA = 1e-3          # fixed seeds make every test deterministic; alpha bounds a false alarm




@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A tiny Qwen3 whose greedy outputs vary (larger weights than conftest's, whose outputs repeat
    one token): the drafts are then sometimes right and sometimes wrong."""
    path = build_tiny_qwen3(tmp_path_factory.mktemp("tiny64"), vocab_size=64, initializer_range=0.25,
                            num_hidden_layers=3)
    return load_model(path, torch.float32)


def _config(model, block_size=4, blocks=200, **kw):
    bpb = KVPool.bytes_per_block(model.config, block_size, model.model.embed_tokens.weight.dtype)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    return PagedSchedulerConfig(block_size=block_size, kv_cache_bytes=blocks * bpb, **kw)


def plain(model, config, **kw):
    """Lesson 15's engine on the model's own (unpacked) linears, every step eager."""
    return lesson16.build_engine(model, config, use_graph=False, pack_weights=False, **kw)


def spec_engine(model, config, **kw):
    """The same engine with speculative decoding."""
    return build_spec_engine(model, config, fast_path=False, use_graph=False, pack_weights=False, **kw)


def check_pool(engine) -> None:
    """After a step: every running sequence holds exactly the blocks of its computed tokens (the
    rejected drafts' blocks went back), reference counts equal the tables, nothing leaks."""
    bm = engine.scheduler.block_manager
    running = engine.scheduler.running
    refs = Counter(b for s in running for b in s.block_table or [])
    assert [b.ref_count for b in bm.blocks] == [refs[i] for i in range(bm.num_blocks)]
    free = list(bm.free_block_ids)
    assert len(set(free)) == len(free) and not set(free) & set(refs)
    assert len(free) + len(refs) == bm.num_blocks
    for s in running:
        assert len(s.block_table or []) == bm.blocks_for(s.num_computed_tokens), (s.seq_id, len(s.block_table), s.num_computed_tokens)
        assert -1 not in s.token_ids                                       # no placeholder left behind
        assert s.num_computed_tokens < s.num_tokens                         # the last token: fed next step


def run_checked(engine, prompts, params) -> list[list[int]]:
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        check_pool(engine)
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    return [s.output_token_ids for s in seqs]


# ---- the pieces ------------------------------------------------------------------------------
def test_prompt_lookup():
    t = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3]
    assert prompt_lookup(t, 2, 1, 3) == [4, 5]          # most recent earlier "1 2 3", then its followers
    assert prompt_lookup(t, 9, 1, 3) == [4, 5, 8, 1, 2, 3]   # can run into the suffix itself
    assert prompt_lookup([5, 6, 1, 2, 6, 1, 3, 1], 3, 1, 3) == [3, 1]   # no 2-gram "3 1" earlier: 1-gram "1"
    assert prompt_lookup([5, 6, 1, 2, 6, 1, 3, 1], 3, 2, 3) == []        # min_n=2: no match
    assert prompt_lookup([1, 2, 3], 4) == [] and prompt_lookup([4], 4) == [] and prompt_lookup(t, 0) == []


def test_verify_greedy():
    assert verify_greedy([5, 6, 9, 1], [5, 6, 7]) == ([5, 6, 9], 2)      # first mismatch: the target's token
    assert verify_greedy([5, 6, 7, 1], [5, 6, 7]) == ([5, 6, 7, 1], 3)   # all accepted + the bonus token
    assert verify_greedy([4], []) == ([4], 0)


def test_rejection_sampler_keeps_the_target_distribution():
    """One position, a draft q far from p: the emitted token is distributed as p (chi-square), a
    token with p = 0 never comes out, one with q = 0 does (only through the residual)."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
    q = torch.tensor([0.05, 0.40, 0.00, 0.15, 0.10, 0.30])
    bonus = torch.full((6,), 1 / 6)
    g = torch.Generator().manual_seed(0)
    n, firsts, accepted = 8000, [], 0
    for _ in range(n):
        x = int(exponential_race(q[None], [g])[0])                          # the draft is drawn from q
        tokens, a = rejection_sample(torch.stack([p, bonus]), [x], q[None], g)
        firsts.append(tokens[0])
        accepted += a
    res = frequency_test(torch.tensor(firsts), p)
    assert res["impossible"] == 0 and res["statistic"] < chi2_critical(res["df"], ALPHA), res
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.02     # P(accept) = sum min(p, q)
    # A point-mass proposal (prompt lookup): accept with probability p(x), else p without x.
    firsts = [rejection_sample(torch.stack([p, bonus]), [1], None, g)[0][0] for _ in range(n)]
    res = frequency_test(torch.tensor(firsts), p)
    assert res["impossible"] == 0 and res["statistic"] < chi2_critical(res["df"], ALPHA), res


# ---- greedy: token for token the engine without speculation ----------------------------------
def _prompts(model, seed=0):
    """Random prompts, some with repeated stretches (prompt lookup finds them)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
    a, b = rnd(7), rnd(5)
    return [a + rnd(3) + a, rnd(11), b + b + b + rnd(2), rnd(4) + a + rnd(6) + a[:4], rnd(17), b + rnd(9) + b]


PROPOSERS = {"ngram": lambda: NgramProposer(1, 3), "skip1": lambda: LayerSkipProposer(1),
             "skip2": lambda: LayerSkipProposer(2)}


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_equals_engine_with_partial_grants_and_preemption(tiny64, proposer, one_thread):
    prompts = _prompts(tiny64)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 22, 26, 17, 30, 24)]
    # 4 running x (1 + 3) tokens > a budget of 10: some get fewer slots than they asked for;
    # 22 blocks of 4 for 6 requests of up to 47 tokens: preemptions.
    config = _config(tiny64, blocks=22, max_num_batched_tokens=10)
    ref = plain(tiny64, config).generate(prompts, params)
    engine = spec_engine(tiny64, config, proposer=PROPOSERS[proposer](), num_speculative_tokens=3)
    assert run_checked(engine, prompts, params) == [s.output_token_ids for s in ref]
    spec = engine.spec
    assert 0 < spec.accepted < spec.drafted                     # both accepted and rejected drafts
    assert engine.scheduler.num_preemptions > 0
    assert spec.tokens_per_forward > 1 and engine.num_steps < len(ref) + sum(p.max_tokens for p in params)


def test_fast_path_model_and_several_draft_lengths(tiny64, one_thread):
    """Lesson 16's fast-path engine without graphs: its model transforms (packed, fused q|k|v and gate|up)
    and sampler, under the draft too."""
    prompts = _prompts(tiny64, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(prompts)
    config = _config(tiny64, max_num_seqs=6)
    ref = [s.output_token_ids for s in fast_path.build_engine(tiny64, config, use_graph=False).generate(prompts, params)]
    for k, proposer in ((0, NgramProposer(2, 4)), (1, NgramProposer(2, 4)), (5, NgramProposer(2, 4)),
                        (3, LayerSkipProposer(2))):
        engine = build_spec_engine(tiny64, config, proposer=proposer, num_speculative_tokens=k, use_graph=False)
        assert type(engine) is SpecEngine
        assert run_checked(engine, prompts, params) == ref, k
        assert (engine.spec.drafted > 0) == (k > 0)


@pytest.mark.parametrize("with_fast_path", [False, True], ids=["capture", "fast_path"])
def test_recorded_decode_steps_and_verification_steps(tiny64, with_fast_path, one_thread):
    """Lesson 16's runners: steps where no sequence has a guess replay a recorded decode
    step, verification steps (1 + k tokens a sequence) take the prompt-step path (lesson 16's fast path: its
    compiled body with a dynamic token count); the tokens of the same engine without graphs."""
    prompts = _prompts(tiny64, seed=4)[:3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 12, 20)]
    config = _config(tiny64, max_num_seqs=4)
    if not with_fast_path:
        ref = plain(tiny64, config)
        engine = build_spec_engine(tiny64, config, proposer=NgramProposer(2, 3), num_speculative_tokens=3,
                                   fast_path=False, pack_weights=False, record_now=False)
    else:
        ref = fast_path.build_engine(tiny64, config, use_graph=False)
        engine = build_spec_engine(tiny64, config, proposer=NgramProposer(2, 3), num_speculative_tokens=3)
    assert isinstance(engine.runner, GraphRunner)
    assert engine.kv_pool.num_blocks == engine.scheduler.block_manager.num_blocks + 1    # the scratch block
    want = [s.output_token_ids for s in ref.generate(prompts, params)]
    assert run_checked(engine, prompts, params) == want
    assert engine.spec.drafted > 0 and sum(engine.runner.replays.values()) > 0


@pytest.mark.slow
def test_embedded_model_greedy_equals_engine(smol_fp32, smol_tokenizer, one_thread):
    questions = ["Repeat exactly: the quick brown fox jumps over the lazy dog.",
                 "Rewrite this code with `x` renamed to `y`:\n\n```python\nx = 1\nprint(x + 1)\n```",
                 "What is the capital of France?"]
    prompts = [chat_prompt_ids(smol_tokenizer, q) for q in questions]
    sp = SamplingParams(temperature=0, max_tokens=24)
    config = _config(smol_fp32, block_size=16, blocks=40, max_num_batched_tokens=256)
    ref = [s.output_token_ids for s in fast_path.build_engine(smol_fp32, config, use_graph=False)
           .generate(prompts, [sp] * 3)]
    ngram = build_spec_engine(smol_fp32, config, use_graph=False, proposer=NgramProposer(1, 3), num_speculative_tokens=4)
    assert run_checked(ngram, prompts, [sp] * 3) == ref
    assert ngram.spec.acceptance_rate > 0.3 and ngram.spec.tokens_per_forward > 1.5
    skip = build_spec_engine(smol_fp32, config, use_graph=False, proposer=LayerSkipProposer(6), num_speculative_tokens=2)
    short = SamplingParams(temperature=0, max_tokens=12)            # its drafts cost time and are rarely right
    assert run_checked(skip, prompts[:1], [short]) == [ref[0][:12]]
    assert skip.spec.drafted > 0


# ---- stopping inside a step that accepted several tokens -------------------------------------
@dataclass
class ScriptedProposer:
    """Proposes what the reference output says comes next (a perfect draft), except that every
    `wrong_every`-th position gets a wrong token: long accepted runs, and rejections where we say."""
    refs: dict[tuple[int, ...], list[int]]
    vocab_size: int
    wrong_every: int = 0

    def propose(self, engine, seqs, ks) -> list[Draft]:
        drafts = []
        for s, k in zip(seqs, ks):
            n = len(s.output_token_ids)
            tokens = self.refs[tuple(s.prompt_token_ids)][n:n + k]
            if self.wrong_every:
                tokens = [(t + 1) % self.vocab_size if (n + i) % self.wrong_every == 0 else t
                          for i, t in enumerate(tokens)]
            drafts.append(Draft(tokens))
        return drafts


def test_rollback_with_scripted_rejections(tiny64, one_thread):
    prompts = _prompts(tiny64, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (25, 18, 30, 21, 27, 16)]
    config = _config(tiny64, blocks=24, max_num_batched_tokens=14)
    ref = [s.output_token_ids for s in plain(tiny64, config).generate(prompts, params)]
    refs = {tuple(p): r for p, r in zip(prompts, ref)}
    for wrong_every in (0, 2, 3, 7):
        engine = spec_engine(tiny64, config, num_speculative_tokens=4,
                             proposer=ScriptedProposer(refs, tiny64.config.vocab_size, wrong_every))
        assert run_checked(engine, prompts, params) == ref, wrong_every
        assert (engine.spec.accepted == engine.spec.drafted) == (wrong_every == 0)


def test_max_tokens_eos_and_stop_tokens_inside_accepted_runs(tiny64, one_thread):
    prompt = _prompts(tiny64, seed=3)[0]
    config = _config(tiny64)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = plain(tiny64, config).generate([prompt], long)[0].output_token_ids
    proposer = ScriptedProposer({tuple(prompt): ref}, tiny64.config.vocab_size)

    def spec(params, **kw):
        e = spec_engine(tiny64, config, proposer=proposer, num_speculative_tokens=4, **kw)
        out = run_checked(e, [prompt], [params])[0]
        return out, e.spec

    for m in range(1, 13):                               # 1 token from the prefill, then up to 5 a step
        out, s = spec(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        assert out == ref[:m] and s.target_forwards == 1 + -(-(m - 1) // 5), m
    dropped = 0
    for tok in sorted(set(ref[1:])):                     # each token of the output as a stop token
        first = ref.index(tok)
        out, s = spec(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok]))
        assert out == ref[:first + 1], tok
        dropped += s.accepted + s.verifications - s.emitted     # verified tokens cut off by the stop
    assert dropped > 0, "no stop token fell inside a run of accepted drafts"
    out, s = spec(SamplingParams(temperature=0, max_tokens=40), eos_ids=[ref[7]])       # EOS the same way
    assert out == ref[:ref.index(ref[7]) + 1] and s.accepted + s.verifications > s.emitted
    out, _ = spec(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), eos_ids=[ref[7]])
    assert out == ref


def test_rejects_bad_settings(tiny64):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec_engine(tiny64, _config(tiny64), num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="fast_path must be True or False"):
        build_spec_engine(tiny64, _config(tiny64), fast_path=16)
    with pytest.raises(TypeError, match="SpecBlockManager"):      # lesson 13's cannot roll back
        lesson16.build_engine(tiny64, _config(tiny64), use_graph=False, engine_class=SpecEngine,
                              block_manager_class=PrefixCachingBlockManager)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)
    engine = spec_engine(tiny64, _config(tiny64), proposer=LayerSkipProposer(9))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5))
    engine.step()                                         # the prefill: no draft yet
    with pytest.raises(ValueError, match="num_layers"):
        engine.step()
    assert Draft([1]).probs is None
