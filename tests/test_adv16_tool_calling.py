"""Advanced lesson 16: tool calling. Parsing (whole and streamed), the tools prompt, tool_choice
constraints, and the server through the official openai client with real local functions."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advanced.adv15_guided_decoding.dfa import compile_regex
from advanced.adv16_tool_calling.agent import TOOLS, agent_loop, convert_units, run_tool_call
from advanced.adv16_tool_calling.parser import (ToolCallStreamParser, join_deltas, parse_tool_calls,
                                                partial_tag_length)
from advanced.adv16_tool_calling.server import merge_pieces
from advanced.adv16_tool_calling.tools import check_tools, render_tool_prompt, tool_choice_constraint

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"a": 2, "op": "+", "b": 3}}\n</tool_call>'


# ---- parsing -----------------------------------------------------------------------------------
def test_parse_keeps_content_and_leaves_malformed_blocks_as_content():
    out = parse_tool_calls("Let me add." + CALL + "\n<tool_call>{not json}</tool_call> and <tool_call>{\"name\"")
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("calculate", {"a": 2, "op": "+", "b": 3})]
    assert out.content == "Let me add.\n<tool_call>{not json}</tool_call> and <tool_call>{\"name\""
    assert parse_tool_calls("no calls").tool_calls == []
    openai = out.tool_calls[0].to_openai()
    assert openai["type"] == "function" and openai["id"].startswith("call_")
    assert isinstance(openai["function"]["arguments"], str)


def test_stream_holds_back_a_partial_tag():
    p = ToolCallStreamParser()
    assert p.feed("Sure <too") == [{"content": "Sure "}]                  # "<too" may become a tag
    assert p.feed('l_call>\n{"name": "calculate", ') == []                 # inside a block: wait
    deltas = p.feed('"arguments": {"a": 1}}\n</tool_call> ok')
    head, args, rest = deltas
    assert head["tool_calls"][0]["function"] == {"name": "calculate", "arguments": ""} and head["tool_calls"][0]["id"]
    assert args["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert rest == {"content": " ok"}
    assert p.feed(" <") == [{"content": " "}] and p.finish() == [{"content": "<"}]
    assert partial_tag_length("x<tool_c") == 7 and partial_tag_length("x<b") == 0
    merged = merge_pieces([{"content": "a"}, head, args])
    assert merged["tool_calls"][0]["function"]["arguments"] == '{"a": 1}' and merged["content"] == "a"


PIECES = st.sampled_from([CALL, "<tool_call>{bad}</tool_call>", "<tool_call>", "</tool_call>", "<", "<tool",
                          "text ", "\n", "é", '<tool_call>{"name": "x"}</tool_call>', "<tool_call>[1]</tool_call>"])


@FAST
@given(st.lists(PIECES, max_size=8).map("".join), st.lists(st.integers(1, 12), max_size=40))
def test_streamed_deltas_join_to_the_whole_parse(text, sizes):
    p, deltas, pos = ToolCallStreamParser(), [], 0
    for n in sizes:
        deltas += p.feed(text[pos:pos + n])
        pos += n
    deltas += p.feed(text[pos:]) + p.finish()
    got, want = join_deltas(deltas), parse_tool_calls(text)
    assert got.content == want.content
    assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in want.tool_calls]


# ---- tools, the prompt, tool_choice ------------------------------------------------------------
@pytest.mark.parametrize("tools, problem", [
    ([], "tools: must be a non-empty list"),
    ([{"type": "function"}], "tools[0]: must be"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([TOOLS[0], TOOLS[0]], "tools[1].function.name: 'calculate' is defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
     "tools[0].function.parameters: not a valid JSON schema"),
])
def test_bad_tool_definitions_name_the_field(tools, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        check_tools(tools)


def test_prompt_has_tools_section_and_feeds_back_calls_and_results(smol_tokenizer):
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": '{"a": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    text = render_tool_prompt(smol_tokenizer, messages, TOOLS)        # SmolLM2: Qwen3's template
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "calculate", "arguments": {"a": 2}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in render_tool_prompt(smol_tokenizer, messages[:1], None)


def _random_match(dfa, rng: random.Random, max_len: int = 3000) -> str:
    """A random string the DFA accepts: a walk over live bytes, stopping at accepting states by chance."""
    state, out = dfa.start, bytearray()
    for _ in range(max_len):
        live = [b for b in range(256) if dfa.table[state, b] != dfa.dead]
        if dfa.accepting[state] and (not live or rng.random() < 0.3):
            return out.decode()
        b = rng.choice(live)
        out.append(b)
        state = int(dfa.table[state, b])
    raise AssertionError("no accepting state reached")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "convert_units"}}])
def test_every_string_the_constraint_allows_parses_and_validates(choice):
    specs = check_tools(TOOLS)
    dfa = compile_regex(tool_choice_constraint(specs, choice).to_regex())
    schemas = {s.name: s.parameters for s in specs}
    rng = random.Random(0)
    for _ in range(30):
        text = _random_match(dfa, rng)
        parsed = parse_tool_calls(text)
        assert parsed.tool_calls and not parsed.content.strip(), text
        for c in parsed.tool_calls:
            assert isinstance(choice, str) or c.name == "convert_units"
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_tool_choice_errors():
    specs = check_tools(TOOLS)
    with pytest.raises(ValueError, match="'nope' is not among tools"):
        tool_choice_constraint(specs, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match='tool_choice: must be "none"'):
        tool_choice_constraint(specs, "always")
    rich = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"anyOf": [{"type": "string"}]}}}}}])
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters: cannot be enforced"):
        tool_choice_constraint(rich, "required")
    assert tool_choice_constraint(rich, "auto") is None


def test_local_functions():
    assert run_tool_call("calculate", '{"a": 6, "op": "*", "b": 7}') == "42"
    assert run_tool_call("convert_units", '{"value": 100, "from_unit": "c", "to_unit": "f"}') == "212.0"
    assert run_tool_call("calculate", '{"a": 1, "op": "/", "b": 0}').startswith("error: ValueError")
    assert convert_units(1, "mi", "km") == pytest.approx(1.609344)


# ---- the embedded SmolLM2: LLM API and the server through the openai client (slow) ---------------
QUESTIONS = ["What is 12.5 times 4?", "How many miles is 42 km?", "Convert 30 degrees Celsius to Fahrenheit."]


@pytest.fixture(scope="module")
def served(smol_dir):
    from types import SimpleNamespace

    from openai import OpenAI

    from advanced.adv02_sampling.server import AdvAsyncLLM
    from advanced.adv15_guided_decoding.engine import GuidedLLM
    from advanced.adv16_tool_calling.server import build_tool_app
    from step20_http_serve.server import ServerThread

    # "auto" (bf16 where the CPU has it): nothing here compares tokens with another engine
    llm = GuidedLLM(smol_dir, dtype="auto", enforce_eager=True, max_num_seqs=8)
    engine = AdvAsyncLLM(llm, "smol-adv16")
    try:
        with ServerThread(build_tool_app(engine)) as url:
            yield SimpleNamespace(llm=llm, client=OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                                         timeout=120))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_required_and_named_calls_parse_and_validate_on_the_embedded_model(served):
    from advanced.adv15_guided_decoding.params import SamplingParams
    from advanced.adv16_tool_calling.llm import chat_with_tools
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "calculate"}}
    asks = [[{"role": "user", "content": q}] for q in QUESTIONS[1:] for _ in range(2)]
    choices = ["required", named] * 2
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=64) for i in range(len(asks))]
    outs = chat_with_tools(served.llm, asks, TOOLS, choices, params, max_calls=1)        # one batch, sampled
    for out, choice in zip(outs, choices):
        assert len(out.tool_calls) == 1 and not out.content.strip(), (choice, out)
        call = out.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert choice == "required" or call.name == "calculate"


@pytest.mark.slow
def test_openai_client_agent_loop_stream_and_errors(served):
    from openai import BadRequestError
    c = served.client
    run = agent_loop(c, "smol-adv16", "What is 12.5 times 4?", first_choice="required", max_turns=2)
    assert run.calls and all(not r.startswith("error") for _, _, r in run.calls), run.calls
    assert isinstance(run.answer, str) and run.answer                  # turn 2: the answer after the result
    assert [m["role"] for m in run.messages[:3]] == ["user", "assistant", "tool"]

    ask = dict(model="smol-adv16", messages=[{"role": "user", "content": "How many miles is 42 km?"}],
               tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80, parallel_tool_calls=False)
    whole = c.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls", whole
    assert len(whole.choices[0].message.tool_calls) == 1
    chunks = list(c.chat.completions.create(**ask, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert streamed[0].id and streamed[0].function.name == whole.choices[0].message.tool_calls[0].function.name
    assert "".join(tc.function.arguments or "" for tc in streamed) == whole.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    bad = [({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among tools"),
           ({"tool_choice": "required"}, "needs tools")]
    for kwargs, problem in bad:
        with pytest.raises(BadRequestError, match=re.escape(problem)) as e:
            c.chat.completions.create(model="smol-adv16", messages=ask["messages"], max_tokens=4, **kwargs)
        assert e.value.body["param"] in ("tools[0].function.name", "tool_choice")
    assert not served.llm.engine.has_unfinished()


# ---- the server's request checks and renderer, without an engine ------------------------------
def _request(**fields):
    from advanced.adv16_tool_calling.server import ToolChatRequest
    req = ToolChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    req.check_unsupported()
    return req


@pytest.mark.parametrize("fields, param, problem", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_server_request_errors_name_the_field(fields, param, problem):
    from step20_http_serve.protocol import APIError
    with pytest.raises(APIError, match=problem) as e:
        _request(**fields)
    assert e.value.param == param and e.value.status == 400


def test_server_request_feeds_back_calls_and_constrains_required():
    call = {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": "{}"}}
    req = _request(tools=TOOLS, tool_choice="required", messages=[
        {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}])
    assert [m.as_dict() for m in req.messages][1:] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                                                       {"role": "tool", "content": "5", "tool_call_id": "c1"}]
    assert req.parse_tools and req.sampling_params(32, None).structured_outputs is not None
    assert not _request(tools=TOOLS, tool_choice="none").parse_tools
    assert _request(tools=TOOLS).sampling_params(32, None).structured_outputs is None       # auto: free


def test_renderer_streams_the_same_calls_it_returns_whole():
    from types import SimpleNamespace

    from advanced.adv16_tool_calling.server import ToolChatRenderer
    from step20_http_serve.async_llm import Delta
    text = "ok " + CALL
    cuts = [text[i:i + 5] for i in range(0, len(text), 5)]
    deltas = [Delta(0, t, 0, None) for t in cuts[:-1]] + [Delta(0, cuts[-1], 0, None, finish_reason="stop")]
    llm = SimpleNamespace(model_name="m")
    streamed = ToolChatRenderer(llm, 1, 3, False, None, parse=True)
    chunks = [c for c in (streamed.chunk(d) for d in deltas) if c is not None]
    whole = ToolChatRenderer(llm, 1, 3, False, None, parse=True)
    for d in deltas:
        whole.add(d)
    choice = whole.response()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" == chunks[-1]["choices"][0]["finish_reason"]
    assert choice["message"]["content"] == "ok "
    joined = join_deltas([c["choices"][0]["delta"] for c in chunks])
    assert joined.content == "ok " and [(c.name, c.arguments) for c in joined.tool_calls] == \
        [(tc["function"]["name"], tc["function"]["arguments"]) for tc in choice["message"]["tool_calls"]]
