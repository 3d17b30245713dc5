"""Tool calling with the LLM API: advanced 15's GuidedLLM, the tools prompt, the parser.

    with GuidedLLM() as llm:
        [out] = chat_with_tools(llm, [messages], tools, tool_choice="required")
        out.tool_calls -> [ToolCall(name, arguments JSON text, id)], out.content -> the rest
    (several conversations go into one batch, guided and free rows side by side)

tool_choice "required" / a named function puts tools.py's constraint into the request's
SamplingParams (structured_outputs), so every call that ends (EOS) parses and its arguments
fit the tool's schema; "auto" generates freely and parses what came; "none" leaves the tools
out of the prompt and does not parse.
"""
from __future__ import annotations

from dataclasses import replace

from advanced.adv15_guided_decoding.engine import GuidedLLM
from advanced.adv15_guided_decoding.params import SamplingParams

from .parser import ParsedOutput, parse_tool_calls
from .tools import MAX_PARALLEL_CALLS, check_tools, render_tool_prompt, tool_choice_constraint


def tool_request(llm: GuidedLLM, messages: list[dict], tools: list[dict] | None, tool_choice="auto",
                 params: SamplingParams | None = None, chat_template_kwargs: dict | None = None,
                 max_calls: int = MAX_PARALLEL_CALLS) -> tuple[list[int], SamplingParams]:
    """The prompt ids and params of one tool-calling request (the server builds the same)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=128)
    specs = check_tools(tools) if tools else []
    if tool_choice not in (None, "auto", "none") and not specs:
        raise ValueError("tool_choice: needs tools")
    constraint = tool_choice_constraint(specs, tool_choice, max_calls) if specs else None
    if constraint is not None:
        params = replace(params, structured_outputs=constraint)
    text = render_tool_prompt(llm.tokenizer, messages, None if tool_choice == "none" else tools, chat_template_kwargs)
    return llm.tokenizer.encode(text, add_special_tokens=False), params


def chat_with_tools(llm: GuidedLLM, conversations: list[list[dict]], tools: list[dict] | None, tool_choice="auto",
                    params: SamplingParams | None = None, max_calls: int = MAX_PARALLEL_CALLS) -> list[ParsedOutput]:
    """One batch; tool_choice (and params) may be one for all or a list, one per conversation."""
    n = len(conversations)
    choices = tool_choice if isinstance(tool_choice, list) else [tool_choice] * n
    plist = params if isinstance(params, list) else [params] * n
    work = [tool_request(llm, m, tools, c, p, max_calls=max_calls) for m, c, p in zip(conversations, choices, plist)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in work], [p for _, p in work], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    return [ParsedOutput(t, []) if c == "none" or not tools else parse_tool_calls(t) for t, c in zip(texts, choices)]
