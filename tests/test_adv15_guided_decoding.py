"""Advanced lesson 15: our regex DFA agrees with Python's re; the token index equals a brute-force
walk and xgrammar's masks on the real SmolLM2 vocabulary; guided rows mixed with free rows in one
batch; every guided output (random regexes, random choices, random schemas, on random logits and
on the tiny model's engine) fully matches or validates; bad constraints name the problem."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advanced.adv15_guided_decoding.dfa import compile_regex
from advanced.adv15_guided_decoding.engine import GuidedEngine
from advanced.adv15_guided_decoding.json_schema import choice_regex, json_object_regex, schema_regex
from advanced.adv15_guided_decoding.params import SamplingParams, StructuredOutputsParams
from advanced.adv15_guided_decoding.regex_dfa import RegexError
from advanced.adv15_guided_decoding.sampler import GuidedSampler, apply_guides
from advanced.adv15_guided_decoding.token_index import GuideState, TokenIndex, TokenVocab
from step06_sampler.params import SamplingParams as PlainParams
from step06_sampler.sampler import Sampler

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

# ---- random regexes in the subset both we and Python's re read the same way ---------------------
ATOMS = st.sampled_from(["a", "b", "c", "-", r"\.", "[a-c]", "[^a]", "[b-c-]", r"\d", "."])


def _regexes(finite: bool):
    reps = ["?", "{2}", "{0,2}", "{1,3}"] + ([] if finite else ["*", "+", "{1,}"])

    def extend(inner):
        return st.one_of(
            st.lists(inner, min_size=2, max_size=3).map("".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
            st.tuples(inner, st.sampled_from(reps)).map(lambda t: "(" + t[0] + ")" + t[1]))
    return st.recursive(ATOMS, extend, max_leaves=6)


@FAST
@given(_regexes(finite=False), st.lists(st.text("abc-.1x", max_size=6), min_size=1, max_size=20))
def test_dfa_fullmatch_equals_python_re(pattern, texts):
    dfa = compile_regex(pattern)
    for t in texts:
        assert dfa.fullmatch(t) == bool(re.fullmatch(pattern, t)), (pattern, t)


@pytest.mark.parametrize("pattern, problem", [("(ab", "missing ')'"), ("*a", "nothing to repeat"),
                                              ("a{3,1}", "m <= n"), (r"\p", "unsupported escape"),
                                              ("[z-a]", "bad class range")])
def test_bad_regex_names_the_problem(pattern, problem):
    with pytest.raises(RegexError, match=re.escape(problem)):
        compile_regex(pattern)


@pytest.mark.parametrize("schema, problem", [({"type": "strnig"}, "type 'strnig' is not supported"),
                                             ({"type": "array"}, "needs 'items'"),
                                             ({"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["b"]}, "required keys ['b']"),
                                             ({"properties": {}}, "needs a 'type'")])
def test_bad_schema_names_the_problem(schema, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))


# ---- a small byte-level vocabulary: every single byte plus multi-byte tokens, like BPE ---------
def _small_vocab(size: int = 512, eos: int = 2) -> TokenVocab:
    rng = random.Random(0)
    pieces = ['{"', '":', '",', '"}', "true", "false", "null", ", ", "ab", "abc", "-1", "00", "12", "cb", "a-",
              "\\n", '\\"', "[]", "[1", "],"]
    multi = pieces + ["".join(rng.choice("abc-.1x\"{}[]:,0123 ") for _ in range(rng.randint(2, 4)))
                      for _ in range(size - 256 - len(pieces))]
    token_bytes: list[bytes | None] = [bytes([b]) for b in range(256)] + [m.encode() for m in multi]
    token_bytes[0] = token_bytes[1] = token_bytes[eos] = None          # pad, bos, eos: special
    return TokenVocab(token_bytes[:size], size, [eos])


VOCAB = _small_vocab()


def _brute_force(index: TokenIndex, state: int) -> torch.Tensor:
    dfa, want = index.dfa, torch.zeros(index.vocab.vocab_size, dtype=torch.bool)
    for t, data in enumerate(index.vocab.token_bytes):
        if data and dfa.walk(state, data) != dfa.dead:
            want[t] = True
    want[index.vocab.eos_ids] = bool(dfa.accepting[state])
    return want


@FAST
@given(_regexes(finite=False))
def test_token_index_equals_brute_force_walk(pattern):
    index = TokenIndex(compile_regex(pattern), VOCAB)
    for state in range(index.dfa.num_states):
        assert torch.equal(index.allowed(state), _brute_force(index, state)), (pattern, state)


def _generate(index: TokenIndex, seed: int, temperature: float, max_tokens: int = 200) -> tuple[bytes, bool]:
    """Random logits (a stand-in model) through the GuidedSampler until EOS."""
    g = torch.Generator().manual_seed(seed)
    guide, sampler, out = GuideState(index), GuidedSampler(), b""
    params = [PlainParams(temperature=temperature, seed=seed)]
    gens = [torch.Generator().manual_seed(seed)]
    for _ in range(max_tokens):
        tok = int(sampler(torch.randn(1, index.vocab.vocab_size, generator=g) * 4, params, gens, guides=[guide])[0])
        if guide.finished:
            return out, True
        out += index.vocab.token_bytes[tok]
    return out, False


@FAST
@given(_regexes(finite=True), st.integers(0, 2**16), st.sampled_from([0.0, 1.0]))
def test_guided_output_on_random_logits_fully_matches(pattern, seed, temperature):
    out, ended = _generate(TokenIndex(compile_regex(pattern), VOCAB), seed, temperature)
    assert ended, "a finite language must end with EOS"
    assert re.fullmatch(pattern, out.decode()), (pattern, out)


@FAST
@given(st.lists(st.text("abc-. x", min_size=1, max_size=5), min_size=1, max_size=5), st.integers(0, 2**16))
def test_guided_choice_is_one_of_the_choices(choices, seed):
    out, ended = _generate(TokenIndex(compile_regex(choice_regex(choices)), VOCAB), seed, 1.0)
    assert ended and out.decode() in choices


SCALAR_SCHEMAS = st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"type": "null"},
                                  {"type": "string", "maxLength": 4}, {"enum": ["x", 1, None, [1]]},
                                  {"type": "number"}, {"const": "a\"b"}])
SCHEMAS = st.recursive(SCALAR_SCHEMAS, lambda inner: st.one_of(
    st.dictionaries(st.sampled_from(["a", "b", "c d", "é"]), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": list(props)}),
    inner.map(lambda item: {"type": "array", "items": item, "maxItems": 2})), max_leaves=4)


@FAST
@given(SCHEMAS, st.integers(0, 2**16))
def test_guided_json_on_random_logits_validates(schema, seed):
    out, ended = _generate(TokenIndex(compile_regex(schema_regex(schema)), VOCAB), seed, 1.0, max_tokens=1000)
    assert ended, "bounded strings, arrays and numbers: a finite language ends with EOS"
    jsonschema.validate(json.loads(out.decode()), schema)


def test_json_object_regex_takes_nested_json_and_rejects_the_rest():
    dfa = compile_regex(json_object_regex(3))
    for text in ['{}', '{"a":[1,{"b":null}],"c":"x\\"y"}', '{"k":-1.5e3,"t":true}']:
        assert dfa.fullmatch(text), text
    for text in ['[]', '{"a":}', '{"a":[[[1]]]}', "{'a':1}"]:
        assert not dfa.fullmatch(text), text


# ---- the batched sampler: only guided rows are masked ---------------------------------------
def test_sampler_masks_only_guided_rows():
    index = TokenIndex(compile_regex("(yes|no)"), VOCAB)
    logits = torch.randn(4, VOCAB.vocab_size, generator=torch.Generator().manual_seed(0))
    params = [PlainParams(temperature=t, seed=7) for t in (0.0, 0.0, 0.8, 0.8)]
    guides = [GuideState(index), None, GuideState(index), None]
    masked = apply_guides(logits, guides)
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])
    assert torch.isinf(masked[0][~index.allowed(0)]).all()
    gens = [torch.Generator().manual_seed(7) for _ in params]
    tokens = GuidedSampler()(logits, params, gens, guides=guides)
    plain = Sampler()(logits, params, [torch.Generator().manual_seed(7) for _ in params])
    assert tokens[1] == plain[1] and tokens[3] == plain[3]         # free rows: what they get alone
    assert all(bool(index.allowed(0)[tokens[i]]) for i in (0, 2))
    assert guides[0].state != index.dfa.start                       # guides stepped with their tokens


# ---- the engine: the tiny Qwen3 with a byte vocabulary, guided and free requests in one batch ---
@pytest.fixture(scope="module")
def tiny_engine(tiny_qwen3_dir):
    from step19_real_model.engine import build_engine
    engine = build_engine(tiny_qwen3_dir, torch.float32, enforce_eager=True)
    try:
        engine.__class__ = GuidedEngine
        engine.sampler = GuidedSampler(engine.sampler)
        engine.guide_vocab = _small_vocab(engine.model.config.vocab_size, engine.eos_ids[0])
        yield engine
    finally:
        engine.close()


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_regexes(finite=True), min_size=1, max_size=3), st.integers(0, 1000))
def test_engine_batches_guided_with_free_requests(tiny_engine, patterns, seed):
    prompt = [5 + (seed + i) % 300 for i in range(6)]
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    guided = [SamplingParams(temperature=0.9, seed=seed + i, max_tokens=64,
                             structured_outputs=StructuredOutputsParams(regex=p)) for i, p in enumerate(patterns)]
    alone = tiny_engine.generate([prompt], [free])[0].output_token_ids
    seqs = tiny_engine.generate([prompt] * (len(guided) + 1), [free, *guided])
    assert seqs[0].output_token_ids == alone
    for seq, pattern in zip(seqs[1:], patterns):
        ids = seq.output_token_ids
        assert ids[-1] in tiny_engine.eos_ids, "a finite language ends with EOS"
        text = b"".join(tiny_engine.guide_vocab.token_bytes[t] for t in ids[:-1]).decode()
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.slow
def test_engine_without_vocabulary_refuses_guided_requests(tiny_engine):
    vocab, tiny_engine.guide_vocab = tiny_engine.guide_vocab, None
    tiny_engine.__dict__.pop("_indexes", None)
    try:
        with pytest.raises(ValueError, match="needs the model's vocabulary"):
            tiny_engine.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
        assert not tiny_engine.has_unfinished()
    finally:
        tiny_engine.guide_vocab = vocab


# ---- the embedded SmolLM2 through GuidedLLM and lesson 20's server (the official openai client) --
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"},
                                           "city": {"enum": ["Paris", "London", "Rome"]}},
          "required": ["name", "age", "city"]}
TASK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20}, "done": {"type": "boolean"},
                                         "tags": {"type": "array", "items": {"enum": ["home", "work"]}, "maxItems": 2},
                                         "owner": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


@pytest.fixture(scope="module")
def served(smol_dir):
    from types import SimpleNamespace

    from openai import OpenAI

    from advanced.adv02_sampling.server import AdvAsyncLLM
    from advanced.adv15_guided_decoding.engine import GuidedLLM
    from advanced.adv15_guided_decoding.server import ChatCompletionRequest, CompletionRequest
    from step20_http_serve.api import build_app
    from step20_http_serve.server import ServerThread

    llm = GuidedLLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=8)
    engine = AdvAsyncLLM(llm, "smol-adv15")
    app = build_app(engine, completion_request=CompletionRequest, chat_request=ChatCompletionRequest)
    try:
        with ServerThread(app) as url:
            yield SimpleNamespace(llm=llm, client=OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                                         timeout=120))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_llm_batch_of_schema_choice_regex_and_free(served):
    so = StructuredOutputsParams
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=64, structured_outputs=so(json=TASK)),
              SamplingParams(temperature=0, max_tokens=4, structured_outputs=so(choice=["yes", "no"])),
              SamplingParams(temperature=0, max_tokens=16, structured_outputs=so(regex=r"\(\d{3}\) \d{3}-\d{4}")),
              SamplingParams(temperature=0, max_tokens=12)]
    asks = [ASK, [{"role": "user", "content": "Describe a task as JSON."}],
            [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
            [{"role": "user", "content": "Give a US phone number."}], [{"role": "user", "content": "Hi!"}]]
    outs = [o.outputs[0] for o in served.llm.chat(asks, params, use_tqdm=False)]       # one batch
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    jsonschema.validate(json.loads(outs[1].text), TASK)
    assert outs[2].text in ("yes", "no")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[3].text)
    assert all(o.finish_reason == "stop" for o in outs[:4])
    alone = served.llm.chat(asks[4], params[4], use_tqdm=False)[0].outputs[0]
    assert outs[4].token_ids == alone.token_ids                       # the free row is untouched


@pytest.mark.slow
def test_server_response_format_and_vllm_fields(served):
    from openai import BadRequestError
    c = served.client
    r = c.chat.completions.create(model="smol-adv15", messages=ASK, temperature=0, max_tokens=48,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "person", "schema": PERSON}})
    ref = served.llm.chat(ASK, SamplingParams(temperature=0, max_tokens=48,
                                              structured_outputs=StructuredOutputsParams(json=PERSON)),
                          use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].message.content == ref
    jsonschema.validate(json.loads(ref), PERSON)
    r = c.completions.create(model="smol-adv15", prompt="The best city is", temperature=0, max_tokens=4,
                             extra_body={"guided_choice": ["Paris", "Rome"]})
    assert r.choices[0].text in ("Paris", "Rome")
    r = c.chat.completions.create(model="smol-adv15", messages=ASK, temperature=0, max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}", r.choices[0].message.content)
    chunks = c.chat.completions.create(model="smol-adv15", messages=ASK, temperature=0, max_tokens=48, stream=True,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": PERSON}})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref    # streamed: the same
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "type 'strnig' is not supported"),
           ({"extra_body": {"guided_regex": "(ab"}}, "missing ')'"),
           ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "only one constraint")]
    for kwargs, problem in bad:
        with pytest.raises(BadRequestError, match=re.escape(problem)):
            c.chat.completions.create(model="smol-adv15", messages=ASK, max_tokens=4, **kwargs)
    assert not served.llm.engine.has_unfinished()
