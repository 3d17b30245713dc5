"""Advanced 15's server (lesson 20's, with penalties and guided decoding) with tool calling.

    request JSON                                      what happens
    tools [{"type": "function", "function": {..}}] -> checked (400 naming tools[i]...), put in the
                                                      prompt by the chat template's tools section
    tool_choice "auto" (default with tools)        -> free output, <tool_call> blocks parsed
                "none"                             -> no tools in the prompt, nothing parsed
                "required" / {"type": "function",  -> advanced 15's constraint on the output
                 "function": {"name": N}}             (tools.py), then parsed
    parallel_tool_calls false                      -> "required" allows one call, not up to 4
    messages: assistant "tool_calls", role "tool"  -> fed back through the template
    response: message.tool_calls, finish_reason "tool_calls"; streamed as OpenAI's
              delta.tool_calls [{index, id, type, function: {name, arguments}}]

Lesson 20's chat route is replaced by one that renders with the tools and answers through a
renderer that parses; everything else (errors, streaming, disconnects, /v1/completions) is
lesson 20's:

    python -m advanced.adv16_tool_calling.server --model PATH --port 8000   (lesson 20's flags)
"""
from __future__ import annotations

from functools import partial

from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import StrictBool, StrictStr

from advanced.adv02_sampling.server import AdvAsyncLLM
from advanced.adv15_guided_decoding import server as adv15
from advanced.adv15_guided_decoding.engine import GuidedLLM
from step20_http_serve.__main__ import main
from step20_http_serve.api import _params, _parse, _read_json, _serve, build_app
from step20_http_serve.async_llm import AsyncLLM, Delta
from step20_http_serve.protocol import APIError, ChatMessage
from step20_http_serve.responses import ChatRenderer
from step20_http_serve.server import build_server as lesson20_build_server

from .parser import ToolCallStreamParser, parse_tool_calls
from .tools import MAX_PARALLEL_CALLS, ToolSpec, check_tools, named_choice, render_tool_prompt, tool_choice_constraint


class ToolMessage(ChatMessage):
    tool_calls: list[dict] | None = None            # an assistant turn that called tools
    tool_call_id: StrictStr | None = None           # a tool turn: which call this result answers

    def as_dict(self) -> dict:
        out = super().as_dict()
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ToolChatRequest(adv15.ChatCompletionRequest):
    messages: list[ToolMessage]
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    def check_unsupported(self) -> None:
        tools, self.tools = self.tools, None         # lesson 20 refuses every tools list
        try:
            super().check_unsupported()
        finally:
            self.tools = tools
        constraint = self.tool_constraint()          # every tools/tool_choice problem: 400 here
        if constraint is not None and super().constraint() is not None:
            raise APIError("tool_choice: a required or named tool call cannot be combined with "
                           "response_format or structured_outputs", "tool_choice")

    def specs(self) -> list[ToolSpec]:
        if self.tools is None:
            return []
        try:
            return check_tools(self.tools)
        except ValueError as e:
            raise APIError(str(e), str(e).split(":")[0]) from None

    @property
    def choice(self) -> Any:
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")

    def tool_constraint(self):
        specs, choice = self.specs(), self.choice
        try:
            if choice not in ("auto", "none"):
                if choice != "required":
                    named_choice(choice)                 # a ValueError for a bad shape
                if not specs:
                    raise ValueError(f"tool_choice: {choice!r} needs tools")
            max_calls = 1 if self.parallel_tool_calls is False else MAX_PARALLEL_CALLS
            return tool_choice_constraint(specs, choice, max_calls) if specs else None
        except ValueError as e:
            param = str(e).split(":")[0]
            raise APIError(str(e), param if param.startswith("tools") else "tool_choice") from None

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def sampling_params(self, max_tokens: int, logprobs: int | None):
        base = super().sampling_params(max_tokens, logprobs)
        constraint = self.tool_constraint()
        return base if constraint is None else replace(base, structured_outputs=constraint)


class ToolChatRenderer(ChatRenderer):
    """Lesson 20's chat renderer; with `parse`, <tool_call> blocks become tool_calls."""

    def __init__(self, *args, parse: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.parse = parse
        self.parsers = [ToolCallStreamParser() for _ in range(self.num_choices)]

    def chunk(self, d: Delta) -> dict | None:
        if not self.parse:
            return super().chunk(d)
        self.tokens[d.index] += 1
        logprobs = self.format_logprobs(d)
        parser = self.parsers[d.index]
        pieces = parser.feed(d.text) + (parser.finish() if d.finish_reason is not None else [])
        delta = merge_pieces(pieces)
        if not delta and d.finish_reason is None and logprobs is None:
            return None
        finish = "tool_calls" if d.finish_reason == "stop" and parser.calls else d.finish_reason
        return self.stream_chunk([{"index": d.index, "delta": delta, "logprobs": logprobs,
                                   "finish_reason": finish, "stop_reason": d.stop_reason}])

    def choice(self, i: int, text: str, finish_reason, stop_reason) -> dict:
        out = super().choice(i, text, finish_reason, stop_reason)
        if self.parse:
            parsed = parse_tool_calls(text)
            if parsed.tool_calls:
                out["message"] = {"role": "assistant", "content": parsed.content if parsed.content.strip() else None,
                                  "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
                if finish_reason == "stop":
                    out["finish_reason"] = "tool_calls"
        return out


def merge_pieces(pieces: list[dict]) -> dict:
    """The parser's deltas of one engine step -> one OpenAI delta (a call's parts joined per index)."""
    content, calls = "", []
    for p in pieces:
        content += p.get("content", "")
        for tc in p.get("tool_calls", []):
            if calls and calls[-1]["index"] == tc["index"]:
                calls[-1]["function"]["arguments"] += tc["function"]["arguments"]
            else:
                calls.append({**tc, "function": dict(tc["function"])})
    return ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})


def prompt_ids(llm: AsyncLLM, req: ToolChatRequest) -> list[int]:
    tools = req.tools if req.parse_tools else None
    try:
        text = render_tool_prompt(llm.tokenizer, [m.as_dict() for m in req.messages], tools, req.chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template's own complaints (jinja raises its own types)
        raise APIError(f"messages: {type(e).__name__}: {e}", "messages") from e
    return llm.tokenizer.encode(text, add_special_tokens=False)


def build_tool_app(engine: AsyncLLM, max_body_bytes: int = 16 * 2**20):
    """Lesson 20's app with advanced 15's requests, its chat route replaced by the tool-calling one."""
    app = build_app(engine, max_body_bytes=max_body_bytes, completion_request=adv15.CompletionRequest,
                    chat_request=ToolChatRequest)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/chat/completions"]

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = _parse(ToolChatRequest, await _read_json(request, max_body_bytes), engine)
        ids = prompt_ids(engine, req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, engine.check_prompt(ids, req.max_new_tokens, "messages"), logprobs)
        renderer = ToolChatRenderer(engine, req.n, len(ids), req.include_usage, logprobs, parse=req.parse_tools)
        return await _serve(request, engine.generate([(ids, params)]), renderer, req.stream)

    return app


# Lesson 20's build_server with GuidedLLM and this lesson's app (its chat route): (app, AdvAsyncLLM).
build_server = partial(lesson20_build_server, llm_class=GuidedLLM, async_llm_class=AdvAsyncLLM, make_app=build_tool_app)


if __name__ == "__main__":
    main(build=build_server)
