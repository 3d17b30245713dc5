"""Why two runs of the same engine on the same workload differ: each run in a fresh process,
variants alternating, and for every run where its time went.

    python step18_benchmark/steady.py                         # 5 runs each: gc as is, gc frozen
    python step18_benchmark/steady.py --runs 7 --requests 64 --variants default freeze
    python step18_benchmark/steady.py --runs 3 --requests 64 --variants default thp

A run is what a user starts: a new process builds the newest engine (lesson 16 + fast path) on
the Qwen3-0.6B shape and serves the workload of lesson 14's benchmark (its first --requests).
Inside it, without changing the engine, the parts of each step are timed by wrapping them
(schedule, KV preparation, the model, the LM head, sampling, the scheduler's bookkeeping; the
rest is the step's own Python), and the process counts what could make a run slow that the
code does not show: garbage-collector pauses (by generation, via gc.callbacks), Dynamo
recompiles, page faults, context switches the kernel forced on us, and the spread of step times.
It also splits the run into steps with prompt rows and decode-only steps, and says how much of
each was attention (lesson 15's kernel).

Variants:
    default   the engine as built
    freeze    gc.freeze() once the engine is built and warm (what vLLM does after start-up): the
              objects made by imports, Dynamo and inductor move to a permanent generation, so a
              full collection no longer walks them
    thp       the process started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc's malloc
              advises its large blocks (torch's tensors, oneDNN's packed weights) as 2 MB pages
              (minivllm_support.cpu.huge_page_malloc_env)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict

VARIANTS = ("default", "freeze", "thp")
PARTS = ("schedule", "prepare_kv", "run_model", "compute_logits", "sampler", "after_step")


class GcClock:
    """Pauses of the cyclic garbage collector, by generation."""

    def __init__(self):
        self.count = defaultdict(int)
        self.seconds = defaultdict(float)
        self.longest = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.count[info["generation"]] += 1
        self.seconds[info["generation"]] += dt
        self.longest = max(self.longest, dt)


def timed(owner, name: str, totals: dict) -> None:
    """Replace owner.name by a wrapper that adds its seconds to totals[label] (instance only)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    setattr(owner, name, wrapper)


def watch_batches(scheduler) -> dict:
    """Keep the batch each schedule() returns in the dict returned (key "batch")."""
    last: dict = {}
    inner = scheduler.schedule

    def schedule(*args, **kwargs):
        last["batch"] = inner(*args, **kwargs)
        return last["batch"]
    scheduler.schedule = schedule
    return last


class AttentionClock:
    """Seconds in lesson 15's kernel, as the fast path's attention op calls it (ops.py looks the
    function up by name at each call), for batches with prompt rows and decode-only ones. On a
    CPU with AMX tiles the prompt chunks go to amx_prefill instead and are not counted here."""

    def __init__(self, totals: dict):
        from step16_cuda_graph.cpu import ops
        self.ops, self.inner = ops, ops.flash_attention_cpu

        def flash(q, k_cache, v_cache, cu_seqlens_q, seq_lens, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.inner(q, k_cache, v_cache, cu_seqlens_q, seq_lens, *args, **kwargs)
            finally:
                kind = "prompt" if q.shape[0] > seq_lens.shape[0] else "decode"
                totals[f"attention_{kind}"] += time.perf_counter() - t0
        ops.flash_attention_cpu = flash

    def undo(self) -> None:
        self.ops.flash_attention_cpu = self.inner


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this machine's CPUs wanted it (/proc/stat's
    steal column, all CPUs), in seconds; 0 where the kernel does not report it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):     # AttributeError: no os.sysconf
        return 0.0


def one_run(variant: str, requests: int, seed: int, threads: int) -> dict:
    import torch
    import torch._dynamo.utils

    from minivllm_support.cli import DTYPES, resolve_dtype_name
    from minivllm_support.workloads import random_qwen3_06b, workload
    from step04_transformer.loader import load_model
    from step06_sampler.params import SamplingParams
    from step12_paged_attention.scheduler import PagedSchedulerConfig
    from step14_batched_forward.bench import QWEN3_06B_SHAPE
    from step16_cuda_graph.cpu.engine import build_engine
    from step16_cuda_graph.cpu.huge_pages import huge_page_bytes

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    dtype = resolve_dtype_name("auto")
    model = load_model(random_qwen3_06b(), DTYPES[dtype])
    engine = build_engine(model, PagedSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                                      kv_cache_bytes=6 * 2**30))
    prompts, outs = workload(requests, seed, QWEN3_06B_SHAPE["vocab_size"])
    totals: dict[str, float] = defaultdict(float)
    for name in ("prepare_kv", "run_model", "compute_logits", "sampler"):     # the sampler: a callable part
        timed(engine, name, totals)
    timed(engine.scheduler, "schedule", totals)
    timed(engine.scheduler, "after_step", totals)
    last = watch_batches(engine.scheduler)
    attention = AttentionClock(totals)
    if variant == "freeze":
        gc.collect()
        gc.freeze()
    clock = GcClock()
    gc.callbacks.append(clock)
    recompiles0 = sum(torch._dynamo.utils.counters["recompiles"].values())
    graphs0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    steal0 = steal_seconds()
    steps: list[float] = []
    t0 = time.perf_counter()
    for p, m in zip(prompts, outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    kinds: dict[str, float] = defaultdict(float)
    while engine.has_unfinished():
        s0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s0)
        kinds["prompt" if any(n > 1 for n in last["batch"].num_tokens) else "decode"] += steps[-1]
    attention.undo()
    secs = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    steal = steal_seconds() - steal0
    gc.callbacks.remove(clock)
    parts = {k: totals[k] for k in PARTS}
    steps.sort()
    return {
        "variant": variant, "dtype": dtype, "tok_s": sum(outs) / secs, "secs": secs, "steps": len(steps),
        "parts": parts, "python": sum(steps) - sum(parts.values()), "kinds": dict(kinds),
        "attention": {k: totals[f"attention_{k}"] for k in ("prompt", "decode")},
        "step_ms": {"median": 1e3 * steps[len(steps) // 2], "p99": 1e3 * steps[int(len(steps) * 0.99)],
                    "max": 1e3 * steps[-1]},
        "gc": {"count": dict(clock.count), "seconds": sum(clock.seconds.values()), "longest_ms": 1e3 * clock.longest,
               "frozen": gc.get_freeze_count()},
        "recompiles": sum(torch._dynamo.utils.counters["recompiles"].values()) - recompiles0,
        "new_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0,
        "minor_faults": usage1.ru_minflt - usage0.ru_minflt, "major_faults": usage1.ru_majflt - usage0.ru_majflt,
        "forced_switches": usage1.ru_nivcsw - usage0.ru_nivcsw,
        "steal_secs": steal, "huge_mb": huge_page_bytes() / 2**20,
        "cpu_secs": (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime),
    }


def spread(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"median {med:.1f}, {min(xs):.1f}-{max(xs):.1f} ({100 * (max(xs) - min(xs)) / med:.0f}% of the median)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs of each variant (alternating)")
    p.add_argument("--requests", type=int, default=16, help="the first N requests of the workload")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["default", "freeze"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)    # a run, in this (fresh) process
    args = p.parse_args()
    if args.runs < 1 or args.requests < 1:
        p.error("--runs and --requests must be >= 1")
    if args.one:
        print(json.dumps(one_run(args.one, args.requests, args.seed, args.threads)))
        return
    from minivllm_support import cpu
    from minivllm_support.cli import machine
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    print(f"workload: lesson 14's first {args.requests} requests (Qwen3-0.6B shape, greedy, ignore_eos), "
          f"max_num_seqs=64, budget 512; each run a fresh process; variants alternate\n")
    head = (f"{'run':>3} {'variant':8} {'tok/s':>6} {'steps':>5} {'sched':>6} {'kv':>5} {'model':>6} {'head':>5} "
            f"{'sample':>6} {'after':>5} {'python':>6} {'p50ms':>6} {'p99ms':>6} {'maxms':>6} {'gc s':>5} "
            f"{'gc max':>6} {'recomp':>6} {'graphs':>6} {'minflt':>7} {'forced':>6} {'prompt':>6} {'decode':>6} "
            f"{'attn p':>6} {'attn d':>6} {'cpu':>5} {'steal':>5} {'hugeMB':>6}")
    print(head)
    results: dict[str, list[dict]] = defaultdict(list)
    for r in range(args.runs):
        for variant in args.variants:
            cmd = [sys.executable, "-m", "step18_benchmark.steady", "--one", variant, "--requests", str(args.requests),
                   "--seed", str(args.seed), "--threads", str(args.threads)]
            env = cpu.huge_page_malloc_env() if variant == "thp" else None
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"a run failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
            x = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(x)
            pt = x["parts"]
            print(f"{r + 1:3d} {variant:8} {x['tok_s']:6.1f} {x['steps']:5d} {pt['schedule']:6.2f} {pt['prepare_kv']:5.2f} "
                  f"{pt['run_model']:6.2f} {pt['compute_logits']:5.2f} {pt['sampler']:6.2f} {pt['after_step']:5.2f} "
                  f"{x['python']:6.2f} {x['step_ms']['median']:6.1f} {x['step_ms']['p99']:6.1f} "
                  f"{x['step_ms']['max']:6.1f} {x['gc']['seconds']:5.2f} {x['gc']['longest_ms']:6.1f} "
                  f"{x['recompiles']:6d} {x['new_graphs']:6d} {x['minor_faults']:7d} {x['forced_switches']:6d} "
                  f"{x['kinds'].get('prompt', 0):6.1f} {x['kinds'].get('decode', 0):6.1f} "
                  f"{x['attention']['prompt']:6.1f} {x['attention']['decode']:6.1f} "
                  f"{x['cpu_secs'] / x['secs']:5.2f} {x['steal_secs']:5.1f} {x['huge_mb']:6.0f}", flush=True)
    print("\n(seconds per run for each part of the step; gc: all pauses, and the longest in ms; prompt / decode: "
          "seconds in steps with prompt rows / in decode-only steps; attn p / attn d: of those, in lesson 15's kernel; "
          "cpu: the process's CPU seconds per second of the run; steal: seconds the hypervisor ran others on this "
          "machine's CPUs (all CPUs); hugeMB: the process's memory on 2 MB pages at the end)")
    for variant, xs in results.items():
        print(f"{variant:8}: output tok/s {spread([x['tok_s'] for x in xs])}; dtype {xs[0]['dtype']}")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
