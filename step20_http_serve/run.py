"""Lesson 20: serve the engine over HTTP the way vLLM does, and talk to it like any client would.

    python step20_http_serve/run.py              # the embedded model, eager decode step (< 2 min)
    python step20_http_serve/run.py --compile    # lesson 16's fast-path compiled decode step (slower start-up)

Starts the server in this process (uvicorn in a thread), then:
  1. the official `openai` client: models, completions and chat, streaming and not, n=2 with a
     seed, logprobs, two client mistakes, and a client that hangs up mid-stream;
  2. lesson 18's load generator over HTTP at a few request rates, and once in-process against
     the same engine (no HTTP), printing TTFT / TPOT / ITL percentiles side by side.
"""
from __future__ import annotations

import asyncio
import math
import os
import time

import openai
from openai import OpenAI

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from minivllm_support.timing import busy_warning
from step18_benchmark.loadgen import Request, http_sender, run_load
from step18_benchmark.metrics import RequestRecord, ServingResult, summarize
from step18_benchmark.run import text_workload
from step19_real_model.params import SamplingParams
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.server import ServerThread, build_server


def timed(label: str, fn):
    t = time.perf_counter()
    out = fn()
    print(f"\n[{label}] {1e3 * (time.perf_counter() - t):.0f} ms")
    return out


def demo(client: OpenAI, model: str, engine: AsyncLLM) -> None:
    print(f"\nGET /v1/models -> {[m.id for m in client.models.list()]}")
    r = timed("completions, greedy", lambda: client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0))
    print(f"  {r.choices[0].text!r}\n  finish_reason={r.choices[0].finish_reason} usage={dict(r.usage)}")

    print("\n[completions, stream] chunk arrival times after the request was sent:")
    t0, pieces = time.perf_counter(), []
    for chunk in client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(f"{1e3 * (time.perf_counter() - t0):.0f}ms {chunk.choices[0].text!r}")
        else:
            usage = chunk.usage
    print("  " + ", ".join(pieces[:8]) + (" ..." if len(pieces) > 8 else ""))
    print(f"  {len(pieces)} chunks; usage chunk: {dict(usage)}")

    question = [{"role": "user", "content": "What is a KV cache? Answer in one sentence."}]
    r = timed("chat, greedy", lambda: client.chat.completions.create(
        model=model, messages=question, max_completion_tokens=48, temperature=0))
    print(f"  {r.choices[0].message.content!r}\n  finish_reason={r.choices[0].finish_reason} usage={dict(r.usage)}")

    t0, first, text = time.perf_counter(), None, ""
    for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=48, temperature=0,
                                                stream=True):
        delta = chunk.choices[0].delta.content or ""
        if delta and first is None:
            first = time.perf_counter() - t0
        text += delta
    total = time.perf_counter() - t0
    same = text == r.choices[0].message.content
    print(f"\n[chat, stream] first text after {1e3 * first:.0f} ms, all after {1e3 * total:.0f} ms;"
          f" same text as without streaming: {same}")
    if not same:
        common = next((i for i, (a, b) in enumerate(zip(text, r.choices[0].message.content)) if a != b), len(text))
        print(f"  they part after {common} characters. The second request found its prompt's full blocks in the "
              f"prefix cache,\n  so its prefill ran on fewer tokens; in bf16 that rounds differently and greedy "
              f"decoding can follow a near-tie\n  the other way (--dtype fp32 gives the same text, as the tests check)")

    r = timed("completions, n=2, temperature 0.8, seed 1", lambda: client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0.8, n=2, seed=1))
    for c in r.choices:
        print(f"  choice {c.index}: {c.text!r}")

    r = client.chat.completions.create(model=model, messages=question, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    print("\n[chat, logprobs=true, top_logprobs=3] the first tokens and their runners-up:")
    for e in r.choices[0].logprobs.content:
        others = "  ".join(f"{t.token!r} {t.logprob:.3f}" for t in e.top_logprobs)
        print(f"  {e.token!r:>14} {e.logprob:7.3f}   {others}")

    print("\nclient mistakes:")
    for kwargs in ({"model": model, "prompt": "hi", "temperature": -1}, {"model": "gpt-5", "prompt": "hi"}):
        try:
            client.completions.create(**kwargs)
        except openai.APIStatusError as e:
            print(f"  {kwargs} -> HTTP {e.status_code}: {e.body}")

    stream = client.completions.create(model=model, prompt="Write a long story.", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    running = [engine.metrics.registry.get_sample_value(n, {"model_name": model})
               for n in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")]
    time.sleep(0.5)
    after = [engine.metrics.registry.get_sample_value(n, {"model_name": model})
             for n in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")]
    print(f"\na client hangs up after 3 chunks of a 200-token stream: running {running[0]:.0f}, KV usage "
          f"{running[1]:.4f} as it leaves; 0.5 s later running {after[0]:.0f}, KV usage {after[1]:.4f}")


def in_process_sender(engine: AsyncLLM):
    """Lesson 18's engine_sender with lesson 19's params: the same engine, no HTTP in between."""
    async def send(req: Request) -> RequestRecord:
        rec = RequestRecord(prompt_len=len(req.prompt_ids), start=time.perf_counter())
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
        async for _ in engine.front.generate(req.prompt_ids, params):
            rec.token_times.append(time.perf_counter())
        rec.output_len, rec.end = len(rec.token_times), time.perf_counter()
        return rec
    return send


def row(name: str, rate: float, res: ServingResult) -> str:
    s = lambda st: f"{st.median:7.1f} {st.p99:7.1f}"  # noqa: E731
    return (f"{name:10s} {rate:>6g} {res.completed:>3d}/{res.completed + res.failed:<3d} {res.duration_s:7.1f} "
            f"{res.output_throughput:8.1f} {s(res.ttft)} {s(res.tpot)} {s(res.itl)} {res.e2el.median:8.0f}")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--requests", type=int, default=16, help="requests in the load test")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each load-test request generates")
    p.add_argument("--rates", type=float, nargs="+", default=[math.inf, 4.0], help="request rates over HTTP")
    p.add_argument("--compile", action="store_true", help="compile the decode step (lesson 16's fast path; slow start-up)")
    args = p.parse_args()
    setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}\nmodel: {folder} ({args.dtype})")
    t0 = time.perf_counter()
    app, engine = build_server(str(folder), served_model_name=folder.name, dtype=args.dtype,
                               enforce_eager=not args.compile, threaded=False)

    def session() -> None:          # uvicorn and the clients; the engine loop is this thread's
        with ServerThread(app) as url:
            print(f"server up at {url} after {time.perf_counter() - t0:.1f} s (model load"
                  f"{' + decode-step compile' if args.compile else ''})")
            demo(OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), folder.name, engine)
            work = text_workload(engine.tokenizer, args.requests, args.max_tokens)
            requests = [Request(ids, args.max_tokens) for ids in work.prompts]
            print(f"\nload test: {len(requests)} chat prompts (shared system prompt, "
                  f"{min(map(len, work.prompts))}-{max(map(len, work.prompts))} tokens), {args.max_tokens} tokens "
                  f"each (ignore_eos), Poisson arrivals; streaming POST /v1/completions with lesson 18's client")
            if warning := busy_warning():
                print(warning)
            t = time.perf_counter()          # every run below then meets the same warm prefix cache
            asyncio.run(run_load(http_sender(url, folder.name), [Request(ids, 1) for ids in work.prompts], math.inf))
            print(f"warm-up: each prompt once with max_tokens=1 ({time.perf_counter() - t:.1f} s): the prefix "
                  f"cache now holds every prompt's full blocks, for every run alike")
            runs = [("in-proc", math.inf, in_process_sender(engine))] + \
                   [("HTTP", rate, http_sender(url, folder.name)) for rate in args.rates]
            print(f"\n{'sender':10s} {'rate':>6s} {'ok':>7s} {'secs':>7s} {'out t/s':>8s} "
                  f"{'TTFT p50':>7s} {'p99':>7s} {'TPOT p50':>7s} {'p99':>7s} {'ITL p50':>7s} {'p99':>7s} "
                  f"{'E2EL p50':>8s}"
                  f"\n{'':36s}(all latencies in ms)")
            for name, rate, send in runs:
                records, secs = asyncio.run(run_load(send, requests, rate))
                print(row(name, rate, summarize(records, secs)), flush=True)
                failed = [r.error for r in records if not r.success]
                if failed:
                    print(f"  failures: {failed[:3]}")
            metrics = engine.metrics.render().decode()
            print("\nGET /metrics (excerpt):")
            for line in metrics.splitlines():
                if line.startswith("vllm:") and "_bucket" not in line and "_created" not in line:
                    print(f"  {line}")

    try:
        engine.front.drive(session)  # the engine loop in the main thread (lesson 18: thread_cost.py)
    finally:
        engine.shutdown()
    print(f"\nload average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
