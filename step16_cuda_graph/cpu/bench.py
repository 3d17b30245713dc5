"""Lesson 16 + fast path measured on the Qwen3-0.6B shape (random weights; --dtype auto: bf16 where the CPU
computes bf16 natively, else fp32; vLLM-CPU gets the same dtype).

    python step16_cuda_graph/cpu/bench.py step       # one decode step's latency at batch 1, 8, 64
                                                   # (context ~360): lesson 15 (eager), lesson 16
                                                   # (compiled), lesson 16 + fast path through Dynamo and with
                                                   # direct calls; plus the record time
    python step16_cuda_graph/cpu/bench.py batch1     # batch-1 decode tok/s (128-token prompt): the same
                                                   # engines, HF generate, vLLM-CPU, the floor
    python step16_cuda_graph/cpu/bench.py prefill    # prompt steps (4 x 512 fresh tokens) eager vs
                                                   # through the dynamic compiled body (mixed.py)
    python step16_cuda_graph/cpu/bench.py workload   # lesson 14's bench workload: lessons 14, 15, 16, 16 + fast path
                                                   # and vLLM-CPU, alternating (--requests N: its first
                                                   # N; --hf-batch B: HF generate too)
    python step16_cuda_graph/cpu/bench.py decode     # a decode step's attention, the KV pool on 4 KB and on 2 MB pages
    python step16_cuda_graph/cpu/bench.py weights    # a batch-1 step's weight reads (gemv_bf16), copies on 4 KB and 2 MB pages
    python step16_cuda_graph/cpu/bench.py linears    # the packed bf16 linear at 1, 8, 64 rows, out of cache
    python step16_cuda_graph/cpu/bench.py phases     # prompt steps alone, then decode steps, lesson 16 + fast path and
                                                   # vLLM-CPU on the same token ids

vLLM-CPU runs only where `make compare-vllm` built its venv (.venv-vllm); each of its runs is a
subprocess of this script (vllm_bench.py), so its figures come from the same session.
Every engine is made by its lesson's `build_engine(model, config, **options)` (lesson 14's by
its class), from the same model: each builds its own transformed copy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path

import torch

from minivllm_support.cli import DTYPES, machine, resolve_dtype_name
from minivllm_support.workloads import weight_floor
from step16_cuda_graph.decode_timing import make_engine, step_turns
from step06_sampler.params import SamplingParams
from step14_batched_forward.bench import QWEN3_06B_SHAPE, random_qwen3_06b, run_engine, run_hf, workload
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention import engine as lesson15
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.cpu import engine as fast_path
from step16_cuda_graph.cpu.bench_decode import run_decode, run_weights
from step16_cuda_graph.cpu.bench_linears import run_linears

ROOT = Path(__file__).resolve().parents[2]           # the repository (this file is step16_cuda_graph/cpu/bench.py)
DTYPE = torch.bfloat16             # main() sets it from --dtype
VLLM_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VARIANTS = {
    "lesson 15 (eager)": (lesson15.build_engine, {}),
    "lesson 16 (compiled)": (lesson16.build_engine, {}),
    "lesson 16 + fast path, via Dynamo": (fast_path.build_engine, {"direct_calls": False}),
    "lesson 16 + fast path": (fast_path.build_engine, {}),
}
LADDER = {"14": (BatchedEngine, {}), "15": (lesson15.build_engine, {}), "16": (lesson16.build_engine, {}),
          "16+": (fast_path.build_engine, {})}


def record_seconds(engine) -> float:
    """Seconds its runner spent recording the buckets (and compiling the prompt step) at build time."""
    return getattr(getattr(engine, "runner", None), "record_seconds", 0.0)


def breakdown(engine, steps: int) -> dict[str, float]:
    """Where a step's milliseconds go, from the profiler's self times (compiled engine)."""
    with torch.profiler.profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    parts = {"linears": 0.0, "attention": 0.0, "fused element-wise": 0.0}
    for ev in prof.key_averages():
        if ev.key in ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"):
            parts["linears"] += ev.self_cpu_time_total
        elif ev.key == "minivllm::paged_attention":
            parts["attention"] += ev.self_cpu_time_total
        elif ev.key.startswith("## Call CompiledFxGraph"):
            parts["fused element-wise"] += ev.self_cpu_time_total
    out = {k: v / 1e3 / steps for k, v in parts.items()}
    out["everything else"] = wall * 1e3 / steps - sum(out.values())
    return out


def vllm(what: str, seed: int, *extra: str) -> dict | None:
    if not VLLM_PYTHON.exists():
        return None
    res = subprocess.run([str(VLLM_PYTHON), str(ROOT / "step18_benchmark" / "vllm_bench.py"), "--what", what,
                          "--seed", str(seed), "--dtype", VLLM_DTYPES[DTYPE], *extra, "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        print(f"vLLM-CPU failed:\n{res.stderr[-1500:]}")
        return None
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])  # after its logs


def variants(model) -> dict:
    return {name: make_engine(model, build, options, kv_gib=2.5)[0] for name, (build, options) in VARIANTS.items()}


def run_step(model, batches: list[int], context: int, rounds: int = 4) -> None:
    for name in ("lesson 16 (compiled)", "lesson 16 + fast path"):
        engine, build_secs = make_engine(model, *VARIANTS[name], kv_gib=2.5)
        print(f"{name}: engine built in {build_secs:.1f} s, of which recording {len(engine.runner.buckets)} buckets"
              f"{' and compiling the prompt step' if name == 'lesson 16 + fast path' else ''} {record_seconds(engine):.1f} s "
              f"(runner mode {engine.runner.mode})")
        del engine
    print(f"one decode step, context ~{context} tokens, max_num_seqs=64 (buckets 1, 2, 4, 8, 16, 32, 48, 64); "
          f"the variants take turns, {rounds} rounds, best round shown")
    print(f"{'batch':>5} " + " ".join(f"{name:>22}" for name in VARIANTS) + "   lesson 16 + fast path / lesson 15")
    for b in batches:
        engines = variants(model)
        best = step_turns(engines, b, context, max(4, 32 // b), rounds)
        parts = breakdown(engines["lesson 16 + fast path"], max(4, 32 // b))
        del engines
        ratio = best["lesson 15 (eager)"] / best["lesson 16 + fast path"]
        print(f"{b:5d} " + " ".join(f"{ms:19.1f} ms" for ms in best.values()) + f"   {ratio:.2f}x faster")
        print("      lesson 16 + fast path, profiled: " + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items()))


def run_batch1(model, seed: int, rounds: int = 4) -> None:
    nbytes, bandwidth, floor = weight_floor(model)
    print(f"batch 1, a 128-token prompt, decode tok/s (16 steps a turn, {rounds} turns each, best turn)")
    engines = variants(model)     # + the fast path with oneDNN for every row count: what our GEMV buys
    engines["  the same, small_rows=False"] = make_engine(model, fast_path.build_engine, {"small_rows": False},
                                                          kv_gib=2.5)[0]
    best = step_turns(engines, 1, 128, 16, rounds)
    engines = None
    for name, ms in best.items():
        print(f"  {name:26s} {1e3 / ms:6.1f} tok/s")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(random_qwen3_06b()), dtype=DTYPE).eval()
    ids = torch.tensor([[random.Random(seed).randrange(1000, 150000) for _ in range(128)]])
    def hf_secs(n: int) -> float:
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0
    hf_secs(2)                                              # warm-up, not timed
    one, many = min(hf_secs(1) for _ in range(2)), min(hf_secs(65) for _ in range(2))
    print(f"  {'HF generate':26s} {64 / (many - one):6.1f} tok/s  (65 tokens minus 1 token, best of 2 each)")
    hf = None                                               # free its weights before vLLM runs
    v = vllm("batch1", seed)
    if v:
        print(f"  {'vLLM-CPU ' + v['vllm_version']:26s} {v['batch1_tok_s']:6.1f} tok/s")
    print(f"  {'floor: weights / bandwidth':26s} {floor:6.1f} tok/s  ({nbytes / 1e9:.2f} GB a step at "
          f"{bandwidth / 1e9:.1f} GB/s)")


def run_prefill(model, rounds: int, seed: int, prompts_per_run: int = 4, length: int = 512) -> None:
    """Prompt steps eager vs compiled (mixed.py): fresh random prompts each run (no prefix hits),
    max_tokens=1, so every step but the last is a 512-token prompt chunk."""
    from minivllm_support.timing import compare, format_ratio
    rng = random.Random(seed)
    vocab = QWEN3_06B_SHAPE["vocab_size"]
    engines = {name: make_engine(model, fast_path.build_engine, {"compile_mixed": mixed}, kv_gib=1.0)[0]
               for name, mixed in (("eager prompt steps", False), ("compiled prompt steps", True))}
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def run(engine):
        def go() -> None:
            for _ in range(prompts_per_run):
                engine.add_request([rng.randrange(1000, vocab - 1000) for _ in range(length)], sp)
            while engine.has_unfinished():
                engine.step()
        return go

    t0 = time.perf_counter()
    for engine in engines.values():     # compile (first shape), then recompile with T symbolic
        for n in (length, length - 37):
            engine.add_request([rng.randrange(1000, vocab - 1000) for _ in range(n)], sp)
            while engine.has_unfinished():
                engine.step()
    print(f"warm-up incl. compiling the dynamic body: {time.perf_counter() - t0:.1f} s")
    timings = compare({name: run(e) for name, e in engines.items()}, repeats=rounds, warmup=False)
    tokens = prompts_per_run * length
    for name, t in timings.items():
        print(f"  {name:22s}: {t.median:5.2f} s for {prompts_per_run} x {length} prompt tokens "
              f"({tokens / t.median:5.0f} tok/s; runs {min(t.seconds):.2f}-{max(t.seconds):.2f} s)")
    eager, compiled = timings.values()
    print(f"  compiled / eager: {format_ratio(eager, compiled)}")


def run_workload(model, rounds: int, seed: int, requests: int = 64, hf_batch: int = 0) -> None:
    prompts, outs = workload(requests, seed, QWEN3_06B_SHAPE["vocab_size"])
    print(f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"outputs {min(outs)}-{max(outs)} (sum {sum(outs)}), ignore_eos; max_num_seqs=64, "
          f"max_num_batched_tokens=512; runs alternate\n")
    engines = LADDER
    best: dict[str, float] = {}
    hf = None
    if hf_batch:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(random_qwen3_06b()), dtype=DTYPE).eval()
    for r in range(rounds):
        if hf is not None:       # lesson 14's bench: left-padded batches of hf_batch, in arrival order
            secs = run_hf(hf, prompts, outs, hf_batch)
            best["HF"] = max(best.get("HF", 0.0), sum(outs) / secs)
            print(f"round {r + 1}, HF generate (batch {hf_batch}): {secs:6.1f} s, {sum(outs) / secs:6.1f} output tok/s",
                  flush=True)
        for name, (build, options) in engines.items():
            secs, prefill_secs, engine = run_engine(model, prompts, outs, 64, 512, 6 * 2**30, engine_class=build,
                                                    **options)
            best[name] = max(best.get(name, 0.0), sum(outs) / secs)
            print(f"round {r + 1}, lesson {name}: {secs:6.1f} s, {sum(outs) / secs:6.1f} output tok/s, "
                  f"{prefill_secs:5.1f} s in steps with prompt tokens, {engine.num_steps} steps", flush=True)
            del engine
        v = vllm("workload", seed, "--requests", str(requests))
        if v:
            best["vLLM"] = max(best.get("vLLM", 0.0), v["workload_tok_s"])
            print(f"round {r + 1}, vLLM-CPU {v['vllm_version']}: {v['workload_secs']:6.1f} s, "
                  f"{v['workload_tok_s']:6.1f} output tok/s", flush=True)
    print(f"\nbest of {rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()) + " output tok/s")
    if "vLLM" in best:
        print(f"lesson 16 + fast path / vLLM-CPU = {best['16+'] / best['vLLM']:.2f}x, lesson 16 / vLLM-CPU = "
              f"{best['16'] / best['vLLM']:.2f}x")
    print(f"lesson 16 + fast path / lesson 16 = {best['16+'] / best['16']:.2f}x, "
          f"lesson 16 + fast path / lesson 14 = {best['16+'] / best['14']:.2f}x"
          + (f", lesson 16 + fast path / HF = {best['16+'] / best['HF']:.2f}x" if "HF" in best else ""))


def run_phases(model, seed: int) -> None:
    """Where lesson 16 + fast path and vLLM-CPU differ: the workload's prompts alone (one token out each),
    then decode steps over short contexts, each engine on the same token ids."""
    from step16_cuda_graph.cpu.measure import phase_workloads
    phases = phase_workloads(seed + 100)
    ours = {}
    for phase, (prompts, outs) in phases.items():     # ours first: vLLM's processes may linger
        ours[phase], _, engine = run_engine(model, prompts, outs, 64, 512, 6 * 2**30,
                                            engine_class=fast_path.build_engine)
        del engine
    v = vllm("phases", seed) or {}
    print(f"{'phase':<24} {'tokens':>20} {'lesson 16 + fast path':>10} {'vLLM-CPU':>9}  lesson 16 + fast path / vLLM time")
    for phase, (prompts, outs) in phases.items():
        theirs = v.get(phase, float("nan"))
        print(f"{phase:<24} {f'{sum(map(len, prompts))} in, {sum(outs)} out':>20} {ours[phase]:9.1f}s "
              f"{theirs:8.1f}s  {ours[phase] / theirs:.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["step", "batch1", "prefill", "workload", "linears", "phases", "decode",
                                     "weights"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=360)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=64, help="workload: how many of its requests")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--hf-batch", type=int, default=0, help="workload: also HF generate in batches of this size")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    global DTYPE
    DTYPE = DTYPES[resolve_dtype_name(args.dtype)]
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}\ndtype: {resolve_dtype_name(args.dtype)}")
    if args.what in ("linears", "decode", "weights"):
        {"linears": lambda: run_linears(vllm), "decode": lambda: run_decode(rounds=max(args.rounds, 6)),
         "weights": lambda: run_weights(rounds=max(args.rounds, 9))}[args.what]()
        print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        return
    from step04_transformer.loader import load_model
    model = load_model(random_qwen3_06b(), DTYPE)
    if args.what == "step":
        run_step(model, args.batches, args.context)
    elif args.what == "batch1":
        run_batch1(model, args.seed)
    elif args.what == "prefill":
        run_prefill(model, max(args.rounds, 3), args.seed)
    elif args.what == "phases":
        run_phases(model, args.seed)
    else:
        run_workload(model, args.rounds, args.seed, args.requests, args.hf_batch)
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
