"""Advanced lesson 17: logits processors.

Unit tests (fast): the persistent batch's bookkeeping under random join/leave/move sequences
equals applying each request's processors alone to its row; each built-in equals its
definition (HF's processors, advanced lesson 02's logit_bias); argmax-invariant processors never
change a greedy token, and the sampler skips them when every row is greedy.
Slow: the real SmolLM2 through the LLM API (a batch with joins and leaves equals each request
alone; min_tokens; raw logprobs) and through the server with the official openai client.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advanced.adv02_sampling.penalties import apply_penalties
from advanced.adv02_sampling.params import SamplingParams as PenaltyParams
from advanced.adv17_logits_processors.builtin_processors import (AllowedTokenIds, EpsilonCutoff, LogitBias,
                                                                 MinTokens, builtin_processors)
from advanced.adv17_logits_processors.params import SamplingParams
from advanced.adv17_logits_processors.persistent_batch import OutputIds, PersistentBatch
from advanced.adv17_logits_processors.processors import (AddedRequest, BatchUpdate, LogitsProcessor, MoveDirection,
                                                         ProcessorSampler)
from step06_sampler.sampler import Sampler

V = 12                    # a small vocabulary keeps hypothesis fast; the rules do not depend on V
EOS = [0]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(eq=False)
class Req:
    """What PersistentBatch reads from lesson 09's Sequence."""
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)


# Custom per-request callables: deterministic functions of (output ids, row).
CUSTOM = [lambda out, row: row + len(out),
          lambda out, row: row.index_fill(0, torch.tensor([len(out) % V]), float("-inf")),
          lambda out, row: row * 0.5]

ids = st.integers(0, V - 1)
params_st = st.builds(
    lambda greedy, mt, allowed, bias, eps, custom, stops, ignore: SamplingParams(
        temperature=0.0 if greedy else 1.0, max_tokens=8, min_tokens=mt, allowed_token_ids=allowed,
        logit_bias=bias, epsilon_cutoff=eps, logits_processors=[CUSTOM[i] for i in custom] or None,
        stop_token_ids=stops, ignore_eos=ignore),
    st.booleans(), st.integers(0, 4), st.none() | st.lists(ids, min_size=1, max_size=4, unique=True),
    st.none() | st.dictionaries(ids, st.floats(-100, 100, allow_nan=False), max_size=3),
    st.sampled_from([0.0, 0.05, 0.2]), st.lists(st.integers(0, len(CUSTOM) - 1), max_size=2),
    st.lists(ids, max_size=2), st.booleans())


def alone(req: Req, row_logits: torch.Tensor) -> torch.Tensor:
    """The reference: fresh processors that only ever saw this one request, in row 0."""
    procs = builtin_processors(V, EOS)
    added = AddedRequest(0, req.params, req.prompt_token_ids, OutputIds(req.token_ids, len(req.prompt_token_ids)))
    x = row_logits.clone()
    for p in procs:
        p.update_state(BatchUpdate(1, added=[added]))
        if p.is_active():
            x = p.apply(x)
    return x


@SETTINGS
@given(pool=st.lists(params_st, min_size=1, max_size=6),
       steps=st.lists(st.lists(st.integers(0, 5), unique=True, max_size=6), min_size=1, max_size=8),
       seed=st.integers(0, 2**31 - 1))
def test_bookkeeping_equals_each_request_alone(pool, steps, seed):
    """Random joins, leaves and reorders: every row of the batched result equals that request's
    processors applied to its row alone, and the persistent batch ends in the step's order."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [Req(p, torch.randint(1, V, (3,), generator=gen).tolist()) for p in pool]
    batch, sampler = PersistentBatch(), ProcessorSampler(lambda *a: None, builtin_processors(V, EOS),
                                                         skip_argmax_invariant=False)
    for step in steps:
        live = [reqs[i] for i in step if i < len(reqs)]
        sampler.update_state(batch.update(live))
        assert batch.rows == live
        logits = torch.randn(len(live), V, generator=gen)
        got = sampler.process(logits, [r.params for r in live])
        for i, r in enumerate(live):
            torch.testing.assert_close(got[i:i + 1], alone(r, logits[i:i + 1]), rtol=0, atol=0, equal_nan=True)
        for r in live:                                  # each live request generates a token
            r.token_ids.append(int(torch.randint(0, V, (), generator=gen)))


def test_persistent_batch_condenses_then_orders():
    """The example of persistent_batch.py's docstring, move by move."""
    a, b, c, d, e = (Req(SamplingParams(), [1]) for _ in range(5))
    batch = PersistentBatch()
    batch.update([a, b, c, d])
    u = batch.update([d, e, a])
    assert [x.row for x in u.added] == [1] and u.removed == [2]
    assert u.moved == [(3, 2, MoveDirection.UNIDIRECTIONAL), (0, 2, MoveDirection.SWAP)]
    assert batch.rows == [d, e, a] and u.batch_size == 3
    assert batch.update([d, e, a]) is None                  # nothing changed: no update at all


def _rows(bu_params: list[SamplingParams], outputs: list[list[int]], proc: LogitsProcessor, prompt=(1, 2)):
    proc.update_state(BatchUpdate(len(bu_params), added=[AddedRequest(i, p, list(prompt), o)
                                                         for i, (p, o) in enumerate(zip(bu_params, outputs))]))
    return proc


logits_st = st.integers(1, 4).flatmap(lambda b: st.lists(
    st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=V, max_size=V), min_size=b, max_size=b))


@SETTINGS
@given(logits=logits_st, data=st.data())
def test_builtins_equal_their_definitions(logits, data):
    """min_tokens = HF's MinNewTokensLengthLogitsProcessor, allowed_token_ids = HF's
    PrefixConstrainedLogitsProcessor, logit_bias = advanced lesson 02's, epsilon_cutoff = HF's
    EpsilonLogitsWarper: row by row, on random logits."""
    from transformers import (EpsilonLogitsWarper, MinNewTokensLengthLogitsProcessor,
                              PrefixConstrainedLogitsProcessor)
    x = torch.tensor(logits)
    B = x.shape[0]
    prompt = [1, 2]
    outs = [data.draw(st.lists(st.integers(1, V - 1), max_size=5)) for _ in range(B)]
    mins = [data.draw(st.integers(0, 6)) for _ in range(B)]
    allowed = [data.draw(st.lists(ids, min_size=1, max_size=5, unique=True)) for _ in range(B)]
    biases = [data.draw(st.dictionaries(ids, st.floats(-100, 100, allow_nan=False), max_size=4)) for _ in range(B)]
    eps = [data.draw(st.floats(1e-4, 0.5)) for _ in range(B)]

    got = _rows([SamplingParams(max_tokens=8, min_tokens=m) for m in mins], outs, MinTokens(EOS)).apply(x.clone())
    for r in range(B):
        want = MinNewTokensLengthLogitsProcessor(len(prompt), mins[r], EOS)(
            torch.tensor([prompt + outs[r]]), x[r:r + 1].clone())
        assert torch.equal(got[r:r + 1], want)

    got = _rows([SamplingParams(allowed_token_ids=a) for a in allowed], outs, AllowedTokenIds(V)).apply(x.clone())
    for r in range(B):
        want = PrefixConstrainedLogitsProcessor(lambda *_: allowed[r], 1)(torch.tensor([prompt]), x[r:r + 1].clone())
        assert torch.equal(got[r:r + 1], want)

    got = _rows([SamplingParams(logit_bias=b or None) for b in biases], outs, LogitBias()).apply(x.clone())
    want = apply_penalties(x, [PenaltyParams(logit_bias=b or None) for b in biases], [prompt] * B, outs)
    assert torch.equal(got, want)

    got = _rows([SamplingParams(epsilon_cutoff=e) for e in eps], outs, EpsilonCutoff()).apply(x.clone())
    for r in range(B):
        want = EpsilonLogitsWarper(eps[r])(torch.tensor([prompt]), x[r:r + 1].clone())
        assert torch.equal(got[r:r + 1], want)


@SETTINGS
@given(logits=logits_st, eps=st.floats(1e-4, 0.99))
def test_argmax_invariant_processors_leave_greedy_tokens(logits, eps):
    """Applied (not skipped), epsilon_cutoff never changes a greedy token; so skipping it is exact."""
    x = torch.tensor(logits)
    params = [SamplingParams(temperature=0, epsilon_cutoff=eps) for _ in range(x.shape[0])]
    forced = ProcessorSampler(Sampler(), [_rows(params, [[]] * len(params), EpsilonCutoff())],
                              skip_argmax_invariant=False)
    assert torch.equal(forced(x, params), Sampler()(x, params))


class Counting(EpsilonCutoff):
    calls = 0

    def apply(self, logits):
        Counting.calls += 1
        return super().apply(logits)


def test_sampler_skips_argmax_invariant_only_when_all_rows_are_greedy():
    x = torch.randn(2, V)
    greedy = [SamplingParams(temperature=0, epsilon_cutoff=0.1)] * 2
    mixed = [greedy[0], SamplingParams(temperature=1.0, epsilon_cutoff=0.1, seed=1)]
    Counting.calls = 0
    sampler = ProcessorSampler(Sampler(), [_rows(greedy, [[], []], Counting())])
    sampler(x, greedy)
    assert Counting.calls == 0 and sampler.skipped == 1
    sampler(x, mixed)
    assert Counting.calls == 1
    # Not argmax-invariant: never skipped. And the logits given to the sampler stay as they were.
    before = x.clone()
    biased = ProcessorSampler(Sampler(), [_rows(greedy, [[], []], LogitBias())])
    params = [SamplingParams(temperature=0, logit_bias={3: 100.0})] * 2
    biased.processors = [_rows(params, [[], []], LogitBias())]
    assert biased(x, params).tolist() == [3, 3] and torch.equal(x, before)


@pytest.mark.parametrize("kwargs, name", [
    ({"min_tokens": 20, "max_tokens": 16}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"epsilon_cutoff": 1.0}, "epsilon_cutoff"),
    ({"logits_processors": ["not callable"]}, "logits_processors"),
])
def test_bad_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}"):
        SamplingParams(**kwargs)


def test_a_custom_processor_returning_the_wrong_shape_is_named():
    params = [SamplingParams(logits_processors=[lambda out, row: row[:3]])]
    sampler = ProcessorSampler(Sampler(), builtin_processors(V, EOS))
    sampler.update_state(PersistentBatch().update([Req(params[0], [1])]))
    with pytest.raises(TypeError, match="logits processor must return"):
        sampler(torch.randn(1, V), params)


# ---------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def llm(smol_dir):
    from advanced.adv17_logits_processors.engine import ProcessorLLM
    with ProcessorLLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=3) as llm:
        yield llm


def _chat(llm, text: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "user", "content": text}])


def _no_repeat(out: list[int], row: torch.Tensor) -> torch.Tensor:
    """A custom per-request processor: never the same token twice in a row."""
    return row.index_fill(0, torch.tensor(out[-1:], dtype=torch.long), float("-inf")) if out else row


@pytest.mark.slow
def test_batch_with_joins_and_leaves_equals_each_request_alone(llm):
    """Six requests, three rows: they join and leave at different steps, each with its own
    processors; every output equals that request run alone (fp32, greedy or seeded)."""
    tok = llm.tokenizer
    word = lambda w: tok.encode(w, add_special_tokens=False)[0]     # noqa: E731
    params = [SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0, max_tokens=5, logit_bias={word(" blue"): 6.0}),
              SamplingParams(temperature=0, max_tokens=5, min_tokens=4),
              SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[word(w) for w in
                                                                              (" yes", " no", " maybe", ".")]),
              SamplingParams(temperature=0, max_tokens=5, logits_processors=[_no_repeat]),
              SamplingParams(temperature=0.8, max_tokens=4, epsilon_cutoff=0.02, seed=3)]
    prompts = [_chat(llm, q) for q in ("Reply with one word: yes or no?", "What colour is the sky?",
                                        "Hi", "Is water wet?", "Count: one one one one", "Tell me a story.")]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, together):
        one = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == one.outputs[0].token_ids
    ids = together[4].outputs[0].token_ids
    assert all(a != b for a, b in zip(ids, ids[1:]))
    assert set(together[3].outputs[0].token_ids) <= set(params[3].allowed_token_ids)
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_min_tokens_holds_eos_back_and_equals_the_callable_version(llm):
    prompt = {"prompt_token_ids": _chat(llm, "Reply with one word: yes or no?")}
    eos = set(llm.engine.eos_ids)

    def hold_eos(out, row):
        return row.index_fill(0, torch.tensor(sorted(eos)), float("-inf")) if len(out) < 6 else row
    plain, held, by_hand = (o.outputs[0] for o in llm.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=10, logits_processors=[hold_eos])], use_tqdm=False))
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 6     # the model stops early by itself
    assert len(held.token_ids) >= 6 and not eos & set(held.token_ids[:5])
    assert by_hand.token_ids == held.token_ids


@pytest.mark.slow
def test_logprobs_stay_raw_under_processors(llm, smol_hf):
    """Restricted to two tokens, the chosen token's logprob and the top-5 are the model's own."""
    tok = llm.tokenizer
    ids = _chat(llm, "Is this review positive or negative? 'A wonderful, moving film.'")
    labels = [tok.encode(w, add_special_tokens=False)[0] for w in (" positive", " negative")]
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                         use_tqdm=False)[0].outputs[0]
    restricted = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                                        allowed_token_ids=labels, logit_bias={labels[1]: 0.5}),
                              use_tqdm=False)[0].outputs[0]
    chosen = restricted.token_ids[0]
    assert chosen in labels
    raw = smol_hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    assert restricted.logprobs[0][chosen].logprob == pytest.approx(float(raw[chosen]), abs=1e-4)
    top = {t: lp.logprob for t, lp in plain.logprobs[0].items()}
    assert {t: lp.logprob for t, lp in restricted.logprobs[0].items() if t != chosen or t in top} == top


# ---------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(llm):
    from openai import OpenAI

    from advanced.adv17_logits_processors.server import (ChatCompletionRequest, CompletionRequest,
                                                         ProcessorAsyncLLM)
    from step20_http_serve.api import build_app
    from step20_http_serve.server import ServerThread
    engine = ProcessorAsyncLLM(llm, "smollm2-adv17")
    app = build_app(engine, completion_request=CompletionRequest, chat_request=ChatCompletionRequest)
    try:
        with ServerThread(app) as url:
            yield OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        engine.shutdown()


REVIEW = [{"role": "user", "content": "Is this review positive or negative? 'Dull and far too long.'"}]


@pytest.mark.slow
def test_server_top_logprobs_unchanged_by_processors(server, llm):
    tok = llm.tokenizer
    labels = [tok.encode(w, add_special_tokens=False)[0] for w in (" positive", " negative")]
    ask = dict(model="smollm2-adv17", messages=REVIEW, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5)
    plain = server.chat.completions.create(**ask)
    forced = server.chat.completions.create(**ask, logit_bias={str(labels[0]): 100},
                                            extra_body={"allowed_token_ids": labels})
    first = lambda r: r.choices[0].logprobs.content[0]                  # noqa: E731
    assert forced.choices[0].message.content == " positive"
    assert [(t.token, t.logprob) for t in first(forced).top_logprobs] == \
           [(t.token, t.logprob) for t in first(plain).top_logprobs]
    assert first(forced).logprob <= first(plain).top_logprobs[0].logprob     # raw: not the model's favourite
    completion = server.completions.create(model="smollm2-adv17", prompt="Reply with one word: yes or no?",
                                           max_tokens=12, temperature=0, extra_body={"min_tokens": 12})
    assert completion.usage.completion_tokens == 12


@pytest.mark.slow
@pytest.mark.parametrize("fields, param", [
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"min_tokens": 20}, "min_tokens"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
])
def test_server_refuses_bad_fields_and_leaves_nothing_behind(server, llm, fields, param):
    from openai import BadRequestError
    with pytest.raises(BadRequestError) as e:
        server.completions.create(model="smollm2-adv17", prompt="Hi", max_tokens=4, extra_body=fields)
    assert e.value.body["param"] == param, e.value.body
    assert not llm.engine.has_unfinished()
