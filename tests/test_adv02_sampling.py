"""Advanced lesson 02: every penalty equals HF's logits processor (or OpenAI's formula) on random
logits; greedy with penalties in the engine equals a plain reference loop token for token;
beam search equals HF generate(num_beams=k) token for token and score for score; bad input
names the field."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from advanced.adv02_sampling.beam_search import BeamSearchParams, beam_search
from advanced.adv02_sampling.engine import AdvEngine, AdvLLM, bad_words_to_ids, build_engine
from advanced.adv02_sampling.params import SamplingParams
from advanced.adv02_sampling.penalties import apply_penalties, banned_tokens
from minivllm_support.models import chat_prompt_ids
from step19_real_model.params import SamplingParams as LLMSamplingParams

V = 64


def _random_case(seed: int, rows: int, prompt_len: int = 12, out_len: int = 9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    prompts = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    outs = [torch.randint(0, V // 4, (out_len - r,), generator=g).tolist() for r in range(rows)]  # repeats
    return logits, prompts, outs


def _hf(processor, ids: list[int], row: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([ids], dtype=torch.long), row.unsqueeze(0).clone())[0]


# ---- each penalty against its reference, rows with different settings in one batch -----------
def test_repetition_penalty_equals_hf():
    logits, prompts, outs = _random_case(0, 4)
    pens = [1.3, 0.7, 1.0, 2.0]                       # > 1 discourages, < 1 encourages, 1 is off
    got = apply_penalties(logits, [SamplingParams(repetition_penalty=p) for p in pens], prompts, outs)
    for r, p in enumerate(pens):
        want = _hf(RepetitionPenaltyLogitsProcessor(p), prompts[r] + outs[r], logits[r])
        assert torch.equal(got[r], want), r
    assert torch.equal(got[2], logits[2])


def test_frequency_and_presence_equal_openai_formula():
    logits, prompts, outs = _random_case(1, 4)
    settings = [(0.5, 0.0), (0.0, 1.25), (-0.75, 0.5), (0.0, 0.0)]
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p) for f, p in settings]
    got = apply_penalties(logits, params, prompts, outs)
    for r, (f, p) in enumerate(settings):
        want = logits[r].clone()
        for t, c in Counter(outs[r]).items():             # generated tokens only, not the prompt
            want[t] -= f * c + p * 1
        assert torch.equal(got[r], want), r


def test_logit_bias_equals_hf_sequence_bias():
    logits, prompts, outs = _random_case(2, 3)
    biases = [{3: 5.0, 10: -2.5, 63: 100.0}, {}, {"7": -100.0}]          # JSON-style string keys too
    got = apply_penalties(logits, [SamplingParams(logit_bias=b) for b in biases], prompts, outs)
    for r, b in enumerate(biases):
        want = logits[r]
        if b:
            want = _hf(SequenceBiasLogitsProcessor({(int(t),): float(v) for t, v in b.items()}), outs[r], logits[r])
        assert torch.equal(got[r], want), r


def test_bad_words_equal_hf_no_bad_words():
    logits, prompts, _ = _random_case(3, 4)
    outs = [[5, 6, 7], [1, 2], [9], [6, 7, 1]]
    words = [[8], [6, 7, 11], [1, 2, 3, 4], [7, 20], [2, 30]]          # one token, prefix hits, misses
    got = apply_penalties(logits, [SamplingParams(bad_words_token_ids=words)] * 4, prompts, outs)
    for r in range(4):
        want = _hf(NoBadWordsLogitsProcessor(words), outs[r], logits[r])
        assert torch.equal(got[r], want), r
    assert banned_tokens(words, outs[0]) == [8, 11, 20]
    assert banned_tokens(words, outs[1]) == [8, 30]


def test_all_together_in_vllm_order():
    logits, prompts, outs = _random_case(4, 3)
    sp = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                        logit_bias={1: 2.0, 40: -3.0}, bad_words_token_ids=[[2], [outs[0][-1], 33]])
    got = apply_penalties(logits, [sp, SamplingParams(), LLMSamplingParams()], prompts, outs)
    want = _hf(NoBadWordsLogitsProcessor(sp.bad_words_token_ids), outs[0], logits[0])
    want = _hf(SequenceBiasLogitsProcessor({(1,): 2.0, (40,): -3.0}), outs[0], want)
    want = _hf(RepetitionPenaltyLogitsProcessor(1.5), prompts[0] + outs[0], want)
    for t, c in Counter(outs[0]).items():
        want[t] -= 0.5 * c + 0.25
    assert torch.equal(got[0], want)
    assert torch.isinf(got[0, 33]) and torch.isinf(got[0, 2])
    assert torch.equal(got[1:], logits[1:])                    # plain rows: untouched, bit for bit
    assert not torch.equal(got[0], logits[0])


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"), ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"), ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"presence_penalty": True}, "presence_penalty"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"), ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": "long"}, "length_penalty"),
])
def test_bad_beam_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


# ---- in the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(smol_dir):
    engine = AdvLLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=16, kv_cache_bytes=64 * 2**20)
    yield engine
    engine.close()


def _reference_greedy(model, prompt: list[int], sp: SamplingParams, eos: list[int]) -> list[int]:
    """Model forward over the whole sequence, HF's processors + OpenAI's formula, argmax."""
    tokens, out = list(prompt), []
    for _ in range(sp.max_tokens):
        logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)))[-1:])[0].float()
        if sp.bad_words_token_ids and out:
            logits = _hf(NoBadWordsLogitsProcessor(sp.bad_words_token_ids), out, logits)
        elif sp.bad_words_token_ids:                     # nothing generated yet: one-token words only
            logits[[w[0] for w in sp.bad_words_token_ids if len(w) == 1]] = float("-inf")
        for t, b in (sp.logit_bias or {}).items():
            logits[t] += b
        if sp.repetition_penalty != 1.0:
            logits = _hf(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty), tokens, logits)
        for t, c in Counter(out).items():
            logits[t] -= sp.frequency_penalty * c + sp.presence_penalty
        tok = int(logits.argmax())
        tokens.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


def test_greedy_with_penalties_equals_reference_loop(llm, smol_fp32, smol_tokenizer):
    prompt = smol_tokenizer.encode("The list of colors: red, blue, red, blue,")    # greedy: " blue, blue, ..."
    no_repeat = bad_words_to_ids(smol_tokenizer, ["blue, blue"])                    # 3 tokens: " blue" "," " blue"
    cases = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
             SamplingParams(temperature=0, max_tokens=12, frequency_penalty=0.5, presence_penalty=0.25),
             SamplingParams(temperature=0, max_tokens=12, bad_words_token_ids=no_repeat, logit_bias={28: -1.5}),
             SamplingParams(temperature=0, max_tokens=12)]
    seqs = llm.engine.generate([prompt] * len(cases), cases)             # one batch, mixed settings
    eos = smol_fp32.config.eos_token_ids
    outs = [s.output_token_ids for s in seqs]
    for sp, got in zip(cases[:-1], outs):
        assert got == _reference_greedy(smol_fp32, prompt, sp, eos)
    assert all(o != outs[-1] for o in outs[:-1]), "each penalty should change this repetitive answer"


def test_llm_generate_bad_words_and_logit_bias(llm):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    plain, banned, forced = llm.chat([q] * 3, [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris"]),
        SamplingParams(temperature=0, max_tokens=4, logit_bias={llm.encode(" banana")[0]: 100.0}),
    ], use_tqdm=False)
    assert "Paris" in plain.outputs[0].text and "Paris" not in banned.outputs[0].text
    assert forced.outputs[0].text.count("banana") >= 3
    assert llm.engine.stats().num_running == 0


def test_logprobs_stay_raw_with_penalties(llm):
    ids = llm.encode("The cat sat on the mat. The cat")
    a, b = llm.generate([ids, ids], [SamplingParams(temperature=0, max_tokens=3, logprobs=2),
                                     SamplingParams(temperature=0, max_tokens=3, logprobs=2, repetition_penalty=2.0,
                                                    logit_bias={5: 30.0})], use_tqdm=False)
    # First step: same context, so the model's own distribution is the same with or without penalties
    first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    top = lambda e: sorted((lp.rank, t, lp.logprob) for t, lp in e.items() if lp.rank <= 2)  # noqa: E731
    assert top(first_a) == top(first_b)
    assert b.outputs[0].token_ids[0] == 5 != a.outputs[0].token_ids[0]


def test_engine_rejects_out_of_vocab_and_untokenized_bad_words(llm):
    v = llm.engine.model.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request([1, 2, 3], SamplingParams(logit_bias={v: 1.0}))
    with pytest.raises(ValueError, match="bad_words"):
        llm.engine.add_request([1, 2, 3], SamplingParams(bad_words=["Paris"]))
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        llm.engine.add_request([1, 2, 3], SamplingParams(bad_words_token_ids=[[v + 5]]))
    assert not llm.engine.has_unfinished()


# ---- beam search -----------------------------------------------------------------------------------
BEAM_QUESTIONS = ["What is 2+2?", "Hi", "Write a haiku about the sea."]


def _hf_beams(hf, prompt, k, n, early_stopping, length_penalty):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=n,
                      early_stopping=early_stopping, length_penalty=length_penalty,
                      return_dict_in_generate=True, output_scores=True)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        seqs.append(gen[:gen.index(2) + 1] if 2 in gen else gen)       # 2 = EOS = the padding here
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("k, early_stopping, length_penalty",     # one case in make test, the others slow (~6 s each)
                         [pytest.param(2, False, 1.0, marks=pytest.mark.slow), (4, True, 1.0),
                          pytest.param(4, "never", 0.5, marks=pytest.mark.slow)])
def test_beam_search_equals_hf_generate(llm, smol_hf, smol_tokenizer, k, early_stopping, length_penalty):
    prompts = [chat_prompt_ids(smol_tokenizer, q) for q in BEAM_QUESTIONS]
    hits = llm.engine.stats().prefix_cache_hits
    params = BeamSearchParams(k, 12, length_penalty=length_penalty, early_stopping=early_stopping)
    ours = beam_search(llm.engine, prompts, params)
    for p, beams in zip(prompts, ours):
        ref, ref_scores = _hf_beams(smol_hf, p, k, 12, early_stopping, length_penalty)
        assert [b.token_ids for b in beams] == ref
        assert [b.score for b in beams] == pytest.approx(ref_scores, abs=1e-4)
        for b in beams:
            assert b.score == pytest.approx(b.cum_logprob / len(b.token_ids) ** length_penalty, abs=1e-5)
            assert b.finish_reason == ("stop" if b.token_ids[-1] == 2 else "length")
    assert any(b.finish_reason == "stop" for beams in ours for b in beams)          # EOS paths exercised
    assert llm.engine.stats().prefix_cache_hits > hits                         # forks reuse the prompt's KV
    assert llm.engine.stats().kv_blocks_used == 0


def test_beam_search_api_and_limits(llm):
    out = llm.beam_search(["The capital of France is"], BeamSearchParams(3, 5))
    assert len(out) == 1 and len(out[0]) == 3
    assert out[0][0].score >= out[0][1].score >= out[0][2].score
    assert out[0][0].text == llm.tokenizer.decode(out[0][0].token_ids, skip_special_tokens=True)
    greedy = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    assert out[0][0].cum_logprob >= greedy.cumulative_logprob - 1e-4      # beam search finds at least as good
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(11, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(2, llm.max_model_len))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[1, 2, 3]], SamplingParams())


def test_build_engine_is_an_adv_engine_and_beam_search_takes_it(smol_dir, llm, smol_tokenizer):
    assert isinstance(llm.engine, AdvEngine)
    engine = build_engine(smol_dir, torch.float32, max_num_seqs=8, kv_cache_bytes=16 * 2**20, enforce_eager=True)
    try:
        prompt = chat_prompt_ids(smol_tokenizer, "Hi")
        a = beam_search(engine, [prompt], BeamSearchParams(2, 6))
        b = beam_search(llm, [prompt], BeamSearchParams(2, 6))
        assert [x.token_ids for x in a[0]] == [x.token_ids for x in b[0]]
    finally:
        engine.close()
