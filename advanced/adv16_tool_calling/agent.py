"""Two real local functions, their OpenAI tool definitions, and an agent loop over the openai client.

    messages -> client.chat.completions.create(tools=TOOLS, tool_choice=...)
             -> message.tool_calls? run each one here (json.loads its arguments, call the function),
                append the assistant turn and one {"role": "tool", "tool_call_id", "content"} per call
             -> ask again (tool_choice "auto"; "none" on the last turn), until an answer with no calls
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

FACTORS = {("km", "mi"): 0.621371, ("mi", "km"): 1.609344, ("kg", "lb"): 2.204623, ("lb", "kg"): 0.453592}
UNITS = ["km", "mi", "kg", "lb", "c", "f"]


def calculate(a: float, op: str, b: float) -> float:
    if op == "/" and b == 0:
        raise ValueError("division by zero")
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[op]


def convert_units(value: float, from_unit: str, to_unit: str) -> float:
    if from_unit == to_unit:
        return value
    if (from_unit, to_unit) == ("c", "f"):
        return value * 9 / 5 + 32
    if (from_unit, to_unit) == ("f", "c"):
        return (value - 32) * 5 / 9
    if (from_unit, to_unit) not in FACTORS:
        raise ValueError(f"cannot convert {from_unit} to {to_unit}")
    return value * FACTORS[from_unit, to_unit]


FUNCTIONS = {"calculate": calculate, "convert_units": convert_units}
NUMBER = {"type": "number"}
TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Compute a op b for two numbers.",
        "parameters": {"type": "object", "properties": {"a": NUMBER, "op": {"enum": ["+", "-", "*", "/"]}, "b": NUMBER},
                       "required": ["a", "op", "b"]}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert a value between units (km, mi, kg, lb, c, f).",
        "parameters": {"type": "object", "properties": {"value": NUMBER, "from_unit": {"enum": UNITS},
                                                        "to_unit": {"enum": UNITS}},
                       "required": ["value", "from_unit", "to_unit"]}}},
]


def run_tool_call(name: str, arguments: str) -> str:
    """Execute one call; what goes back to the model is the result, or the error, as text."""
    try:
        result = FUNCTIONS[name](**json.loads(arguments))
    except (KeyError, TypeError, ValueError) as e:
        return f"error: {type(e).__name__}: {e}"
    return json.dumps(round(result, 4))


@dataclass
class AgentRun:
    answer: str | None = None
    calls: list[tuple[str, str, str]] = field(default_factory=list)    # (name, arguments, result)
    messages: list[dict] = field(default_factory=list)


def agent_loop(client, model: str, question: str, first_choice="required", max_turns: int = 2,
               max_tokens: int = 48, parallel_tool_calls: bool = False) -> AgentRun:
    run = AgentRun(messages=[{"role": "user", "content": question}])
    for turn in range(max_turns):
        # the first turn as asked; the last with tool_choice "none", so that the loop ends in an answer
        choice = first_choice if turn == 0 else ("none" if turn == max_turns - 1 else "auto")
        r = client.chat.completions.create(model=model, messages=run.messages, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=max_tokens,
                                           parallel_tool_calls=parallel_tool_calls)
        msg = r.choices[0].message
        if not msg.tool_calls:
            run.answer = msg.content
            return run
        run.messages.append({"role": "assistant", "content": msg.content,
                             "tool_calls": [c.model_dump() for c in msg.tool_calls]})
        for c in msg.tool_calls:
            result = run_tool_call(c.function.name, c.function.arguments)
            run.calls.append((c.function.name, c.function.arguments, result))
            run.messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return run
