"""Qwen3's chat template (ChatML), written out in Python instead of Jinja.

A chat model never sees "messages"; it sees one string in which every turn is wrapped as

    <|im_start|>{role}\\n{content}<|im_end|>\\n

and, to ask the model to answer, the string ends with the generation prompt
`<|im_start|>assistant\\n`. The model then writes the assistant turn and ends it with
`<|im_end|>`, which is why that token is Qwen3's end-of-sequence token.

Qwen3 adds "thinking": an assistant turn may hold `<think>...</think>` reasoning. The
template keeps the reasoning only for assistant turns after the last user question and
drops it from older turns; `enable_thinking=False` pre-fills an empty think block so the
model answers directly. This module reproduces the template in tokenizer_config.json for
system / user / assistant / tool messages (tool *definitions* and tool *calls* are left out).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")


def _check(messages: Sequence[Mapping]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise TypeError(f"message {i} content must be str, got {type(m['content']).__name__}")
        if m.get("tool_calls"):
            raise ValueError(f"message {i} has tool_calls, which this template does not render")


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def _split_reasoning(m: Mapping) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message."""
    content = m["content"]
    if m.get("reasoning_content") is not None:
        return m["reasoning_content"], content
    if "</think>" in content:
        before, after = content.split("</think>")[0], content.split("</think>")[-1]
        return before.rstrip("\n").split("<think>")[-1].lstrip("\n"), after.lstrip("\n")
    return "", content


def render_chat(messages: Sequence[Mapping], add_generation_prompt: bool = True,
                enable_thinking: bool = True) -> str:
    """Render messages the way Qwen3's tokenizer_config.json chat template does."""
    _check(messages)
    out: list[str] = []
    n = len(messages)
    # The last real user question (a user turn that is not just wrapped tool output).
    last_query = next((i for i in range(n - 1, -1, -1) if messages[i]["role"] == "user"
                       and not _is_tool_response(messages[i]["content"])), n - 1)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "user" or role == "system":
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            reasoning, answer = _split_reasoning(m)
            if i > last_query and (i == n - 1 or reasoning):
                out.append(f"{IM_START}assistant\n<think>\n{reasoning.strip(chr(10))}\n"
                           f"</think>\n\n{answer.lstrip(chr(10))}")
            else:
                out.append(f"{IM_START}assistant\n{answer}")
            out.append(f"{IM_END}\n")
        else:  # tool results are grouped into one user turn
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append(f"{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
        if not enable_thinking:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)
