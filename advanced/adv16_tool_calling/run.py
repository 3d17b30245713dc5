"""Advanced lesson 16: tool calling with the embedded model, through the OpenAI server and client.

    python advanced/adv16_tool_calling/run.py            # 6 questions (or --model FOLDER)
    python advanced/adv16_tool_calling/run.py --quick    # 3 questions

An in-process server (server.py on lesson 20's ServerThread), the official openai client, two
real local functions (agent.py: a calculator and a unit converter). First each question is
asked once with tool_choice "auto" and once with "required" (each mode's requests sent together,
so the engine batches them): how many answers carry tool calls, how many of those parse, fit
the tool's schema and give the right result when run. Then the agent loop: the required call,
the function run here, its result fed back as a `tool` message, and the model's answer.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
from openai import OpenAI

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from step20_http_serve.server import ServerThread

from advanced.adv16_tool_calling.agent import TOOLS, agent_loop, run_tool_call
from advanced.adv16_tool_calling.server import build_server

# (question, the result a correct call returns)
QUESTIONS = [("What is 12.5 times 4?", 50.0), ("How many miles is 42 km?", 26.0976),
             ("Convert 30 degrees Celsius to Fahrenheit.", 86.0), ("What is 1234 minus 567?", 667.0),
             ("How many kilograms is 150 lb?", 68.0388), ("What is 81 divided by 9?", 9.0)]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MODEL = "smol-adv16"


def check_call(call) -> tuple[bool, float | None]:
    """(arguments parse and fit the tool's schema, the result of running it or None)."""
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False, None
    result = run_tool_call(call.function.name, call.function.arguments)
    return True, None if result.startswith("error") else float(result)


def compare_modes(client: OpenAI, questions: list[tuple[str, float]]) -> None:
    print(f"== tool_choice auto vs required: {len(questions)} questions, greedy, max_tokens 64, sent together")
    print(f"{'tool_choice':<12} {'with calls':>10} {'valid':>6} {'right':>6} {'tokens':>7} {'wall s':>7}")
    first = {}
    for mode in ("auto", "required"):
        def ask(q: str):
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                  tools=TOOLS, tool_choice=mode, temperature=0, max_tokens=64,
                                                  parallel_tool_calls=False)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(questions)) as pool:
            replies = list(pool.map(ask, [q for q, _ in questions]))
        wall = time.perf_counter() - t0
        with_calls = valid = right = 0
        for (q, want), r in zip(questions, replies):
            calls = r.choices[0].message.tool_calls or []
            with_calls += bool(calls)
            checks = [check_call(c) for c in calls]
            valid += bool(calls) and all(ok for ok, _ in checks)
            right += any(res is not None and abs(res - want) < 0.01 for _, res in checks)
        tokens = sum(r.usage.completion_tokens for r in replies)
        print(f"{mode:<12} {with_calls:>6}/{len(questions):<3} {valid:>6} {right:>6} {tokens:>7} {wall:>7.1f}")
        first[mode] = replies[0].choices[0].message
    auto, req = first["auto"], first["required"]
    print(f"   auto, question 1:     content={(auto.content or '')[:90]!r} tool_calls={len(auto.tool_calls or [])}")
    call = req.tool_calls[0].function if req.tool_calls else None
    print(f"   required, question 1: {call.name}({call.arguments})" if call else "   required, question 1: no call")


def stream_check(client: OpenAI, question: str) -> None:
    """The same required call streamed: OpenAI's tool_call deltas, joined, against the whole answer."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice="required",
               temperature=0, max_tokens=64, parallel_tool_calls=False)
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls[0].function
    chunks = [ch for ch in client.chat.completions.create(**ask, stream=True) if ch.choices]
    parts = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    name = "".join(tc.function.name or "" for tc in parts if tc.function)
    args = "".join(tc.function.arguments or "" for tc in parts if tc.function)
    print(f"\n== streamed (question 1, required): {len(chunks)} chunks, {len(parts)} tool_call deltas, "
          f"finish_reason {chunks[-1].choices[0].finish_reason!r}; joined equals the whole answer: "
          f"{(name, args) == (whole.name, whole.arguments)}")


def agent(client: OpenAI, questions: list[tuple[str, float]]) -> None:
    print("\n== the agent loop: turn 1 tool_choice required, the function runs here, turn 2 answers")
    for q, want in questions:
        t0 = time.perf_counter()
        run = agent_loop(client, MODEL, q, first_choice="required", max_turns=2, max_tokens=48)
        calls = "; ".join(f"{name}({args}) -> {result}" for name, args, result in run.calls) or "no call"
        print(f"Q: {q}  (right result: {want})\n   call: {calls}\n   answer: {(run.answer or '').strip()[:160]!r}"
              f"  [{time.perf_counter() - t0:.1f} s]")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="3 questions instead of 6")
    args = p.parse_args()
    setup(args)
    folder = resolve_model(args.model)
    questions = QUESTIONS[:3] if args.quick else QUESTIONS
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    # enforce_eager: lesson 16's compiled decode steps take minutes to record on a small CPU.
    app, engine = build_server(str(folder), served_model_name=MODEL, dtype=args.dtype, max_num_seqs=8,
                               enforce_eager=True)
    try:
        with ServerThread(app) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
            compare_modes(client, questions)
            stream_check(client, questions[0][0])
            agent(client, questions[:3])
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
