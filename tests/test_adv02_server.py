"""Advanced lesson 02 over HTTP: lesson 20's server with penalties, logit_bias and bad_words
in the request, checked with the official openai client against the in-process AdvLLM.

One live server (the embedded SmolLM2 in fp32, eager) for the module; references come from
the same AdvLLM before the server starts, so the HTTP path must reproduce them exactly.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from openai import BadRequestError, OpenAI

from advanced.adv02_sampling.engine import AdvLLM
from advanced.adv02_sampling.params import SamplingParams
from advanced.adv02_sampling.server import AdvAsyncLLM, ChatCompletionRequest, CompletionRequest
from step20_http_serve.api import build_app
from step20_http_serve.server import ServerThread

MODEL = "smollm2-adv02"
PROMPT = "The list of colors: red, blue, red, blue,"
PENALTIES = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.2}}


@pytest.fixture(scope="module")
def server(smol_dir):
    llm = AdvLLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=8)
    ref = SimpleNamespace(
        plain=llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0],
        penalised=llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.0,
                                                      frequency_penalty=0.5, repetition_penalty=1.2),
                               use_tqdm=False)[0],
        paris_id=llm.tokenizer.encode(" Paris", add_special_tokens=False))
    engine = AdvAsyncLLM(llm, MODEL)
    app = build_app(engine, completion_request=CompletionRequest, chat_request=ChatCompletionRequest)
    try:
        with ServerThread(app) as url:
            yield SimpleNamespace(url=url, ref=ref, llm=llm,
                                  client=OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60))
    finally:
        engine.shutdown()


def _complete(server, **kw):
    kw = {"max_tokens": 16, **kw}
    return server.client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kw)


def test_penalties_over_http_equal_the_llm(server):
    assert server.ref.penalised.outputs[0].text != server.ref.plain.outputs[0].text   # they do something
    r = _complete(server, **PENALTIES)
    assert r.choices[0].text == server.ref.penalised.outputs[0].text
    assert _complete(server).choices[0].text == server.ref.plain.outputs[0].text   # off by default


def test_streamed_with_penalties_equals_whole(server):
    chunks = _complete(server, stream=True, **PENALTIES)
    assert "".join(c.choices[0].text for c in chunks) == server.ref.penalised.outputs[0].text


def test_logit_bias_forces_a_token_and_bad_words_ban_one(server):
    tok = server.llm.tokenizer
    target = tok.encode(" green", add_special_tokens=False)[0]
    r = _complete(server, logit_bias={str(target): 100}, max_tokens=4, logprobs=0)
    assert r.choices[0].logprobs.tokens == [tok.decode([target])] * 4
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    plain = server.client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0)
    banned = server.client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0,
                                                   extra_body={"bad_words": ["Paris"]})
    assert "Paris" in plain.choices[0].message.content
    assert "Paris" not in banned.choices[0].message.content


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"extra_body": {"bad_words": [""]}}, "bad_words[0]"),
    ({"extra_body": {"bad_words": "Paris"}}, "bad_words"),
])
def test_bad_fields_are_400_naming_the_field(server, fields, param):
    with pytest.raises(BadRequestError) as e:
        _complete(server, **fields)
    assert e.value.body["param"] == param, e.value.body


def test_nothing_left_in_the_engine_after_refusals(server):
    # A refused request must not leave a queued engine request behind (the checks run first).
    for bias in ({"10000000": 1}, {"abc": 1}):
        with pytest.raises(BadRequestError):
            _complete(server, logit_bias=bias)
    asyncio.run(asyncio.sleep(0.1))
    assert not server.llm.engine.has_unfinished()
