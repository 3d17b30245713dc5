"""<tool_call> blocks in the model's text -> OpenAI `tool_calls`, whole or streamed.

    text:    I'll check.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>
    parsed:  content "I'll check."
             tool_calls [{"id": "call_..", "type": "function",
                          "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]

A block counts as a call when the text between the tags is a JSON object with a string "name"
and an object "arguments" (missing: {}). Anything else inside the tags (malformed JSON, a
missing name) stays in the content, tags included, as vLLM's hermes parser leaves it: the
client sees what the model wrote instead of a call that cannot run. A "<tool_call>" with no
closing tag is content too.

Streaming: text arrives a few characters at a time, and a chunk may end in "<too". The
stream parser holds back any tail that could still become "<tool_call>", and everything from
an opening tag on until its closing tag has come, because only then is it known whether the
block is a call or content. A call goes out as OpenAI's deltas: {index, id, type, name,
arguments ""} first, then its arguments. Joined, the deltas equal `parse_tool_calls` of the
whole text, however the text was cut (tests/test_adv16_tool_calling.py, hypothesis).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str                       # a JSON object, as text (OpenAI sends a string)
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str                         # the text outside the call blocks
    tool_calls: list[ToolCall]


def call_from_block(inner: str) -> ToolCall | None:
    """The text between the tags -> a call, or None when it is not one."""
    try:
        obj = json.loads(inner)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> ParsedOutput:
    """The whole output at once."""
    content, calls, pos = [], [], 0
    for m in BLOCK.finditer(text):
        call = call_from_block(m.group(1))
        content.append(text[pos:m.start()] if call is not None else text[pos:m.end()])
        if call is not None:
            calls.append(call)
        pos = m.end()
    content.append(text[pos:])
    return ParsedOutput("".join(content), calls)


def partial_tag_length(text: str, tag: str = OPEN) -> int:
    """How many characters at the end of `text` could be the start of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStreamParser:
    """feed(text) -> OpenAI delta dicts ({"content": ..} or {"tool_calls": [..]}); finish() at the end."""

    def __init__(self) -> None:
        self.buffer = ""                 # held back: a possible partial tag, or an open block
        self.inside = False              # the buffer starts with an opening tag
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        out: list[dict] = []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                cut = at if at >= 0 else len(self.buffer) - partial_tag_length(self.buffer)
                if cut:
                    out.append({"content": self.buffer[:cut]})
                    self.buffer = self.buffer[cut:]
                if at < 0:
                    return out
                self.inside = True
            end = self.buffer.find(CLOSE, len(OPEN))
            if end < 0:
                return out
            block, self.buffer = self.buffer[:end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            self.inside = False
            call = call_from_block(block[len(OPEN):-len(CLOSE)])
            out += [{"content": block}] if call is None else self._call_deltas(call)

    def finish(self) -> list[dict]:
        """The end of the output: whatever is held back (an unclosed block, a partial tag) is content."""
        rest, self.buffer, self.inside = self.buffer, "", False
        return [{"content": rest}] if rest else []

    def _call_deltas(self, call: ToolCall) -> list[dict]:
        index = len(self.calls)
        self.calls.append(call)
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def join_deltas(deltas: list[dict]) -> ParsedOutput:
    """What a client rebuilds from streamed deltas (as the openai client's helpers do)."""
    content, calls = [], {}
    for d in deltas:
        content.append(d.get("content") or "")
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            slot["name"] += tc.get("function", {}).get("name", "")
            slot["arguments"] += tc.get("function", {}).get("arguments", "")
    return ParsedOutput("".join(content), [ToolCall(c["name"], c["arguments"], c["id"]) for _, c in sorted(calls.items())])
