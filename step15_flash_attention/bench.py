"""Lesson 15 against lesson 14 on the Qwen3-0.6B shape (random weights, bf16), three measurements.

    python step15_flash_attention/bench.py kernel      # a core's float32 / bf16 ceilings; one layer's prompt
                                                        # attention with each tile path (bf16); then one
                                                        # causal 8k sequence: our C++ kernel vs torch's
                                                        # CPU flash SDPA
    python step15_flash_attention/bench.py prefill     # one long prompt (2k, 8k, 16k; --lengths, --long
                                                        # adds 32k) chunked at 512 tokens a step:
                                                        # wall time, prefill tok/s, peak memory
    python step15_flash_attention/bench.py workload    # lesson 14's bench workload (64 requests),
                                                        # lesson 14 and 15 alternating
    python step15_flash_attention/bench.py decode      # a decode step's attention, 28 layers, blocks
                                                        # scattered over a pool: the K/V read rate
                                                        # against the machine's (a float32 sum)

Each prefill run is its own process; the memory printed is how far its peak resident memory
(VmHWM, reset once the model and the zero-filled KV pool are resident) rose during the prefill:
the working memory of the forward passes, next to the bytes of K/V the prompt fills.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from minivllm_support.cli import machine
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.bench import QWEN3_06B_SHAPE, random_qwen3_06b, run_engine, workload
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention.engine import build_engine

# Lesson 14's engine class and lesson 15's build_engine: both take (model, config, **options).
ENGINES = {"14": (BatchedEngine, {}), "15": (build_engine, {"attention_backend": "cpu"})}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> int:
    """Current resident memory in bytes, with the kernel's peak (VmHWM) reset to it."""
    with open("/proc/self/clear_refs", "w") as f:   # "5" resets the peak RSS (Linux >= 4.0)
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def linear_rates(rows: int = 512) -> None:
    """The same gap in torch: a 1024 -> 3072 linear over `rows` tokens, float32 vs bf16."""
    from step14_batched_forward.packed_linear import PackedLinear, can_pack
    x, lin = torch.randn(rows, 1024), torch.nn.Linear(1024, 3072, bias=False)
    xb, wb = x.bfloat16(), lin.weight.bfloat16()
    cases = [("float32 F.linear", lambda: lin(x)), ("bf16 F.linear", lambda: F.linear(xb, wb))]
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
        if can_pack(dtype):          # what lesson 14 packs on this CPU
            packed = PackedLinear(torch.nn.Linear(1024, 3072, bias=False).to(dtype))
            cases.append((f"{name} oneDNN-packed (lesson 14)", lambda p=packed, a=x.to(dtype): p(a)))
    for name, fn in cases:
        fn()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        secs = (time.perf_counter() - t0) / 10
        print(f"  {name:32s} {secs * 1e3:6.2f} ms  {2 * rows * 1024 * 3072 / secs / 1e9:6.1f} GFLOP/s")


def tile_paths(rounds: int, threads: int) -> None:
    """One layer's prompt attention (bf16, 16 q / 8 KV heads, D 128, block 16) with each way of
    doing the tile products (MINIVLLM_PREFILL_TILES), alternating in one process: medians."""
    from step15_flash_attention import flash_cpu
    if not flash_cpu.load().flash_prefill_bf16_built():
        print("prompt tiles: float32 FMAs only (this build has no AVX512-BF16)")
        return
    saved = os.environ.pop(flash_cpu.TILES_VAR, None)
    print(f"one layer's prompt attention by tile path, bf16, {threads} threads, median of {rounds} "
          f"alternating rounds ({flash_cpu.TILES_VAR}=auto picks {flash_cpu.prefill_tiles()} here):")
    paths = {"f32": "float32 FMAs", "bf16-scores": "bf16 dot products for S only", "bf16": "bf16 dot products"}
    g = torch.Generator().manual_seed(0)
    for chunk, context in ((512, 512), (512, 2048), (4096, 4096)):   # a first chunk, a later chunk, a long prompt
        nb = context // 16
        k_pool, v_pool = (torch.randn(nb, 8, 16, 128, generator=g).bfloat16() for _ in range(2))
        q = torch.randn(chunk, 16, 128, generator=g).bfloat16()
        tables = torch.randperm(nb, generator=g)[None]                  # scattered blocks
        case = (q, k_pool, v_pool, torch.tensor([0, chunk]), torch.tensor([context]), tables)
        flops = 4 * 16 * 128 * chunk * (context - chunk / 2)        # QK^T and PV, causal
        times: dict[str, list[float]] = {p: [] for p in paths}
        outs = {}
        for _ in range(rounds + 1):                                 # the first round warms up
            for p in paths:
                os.environ[flash_cpu.TILES_VAR] = p
                t0 = time.perf_counter()
                outs[p] = flash_cpu.flash_attention_cpu(*case)
                times[p].append(time.perf_counter() - t0)
        for p, label in paths.items():
            secs = statistics.median(times[p][1:])
            diff = (outs[p].float() - outs["f32"].float()).abs().max().item()
            print(f"  {chunk:4d} queries, {context:4d} keys  {label:30s} {secs * 1e3:8.1f} ms  "
                  f"{flops / secs / 1e9:6.1f} GFLOP/s  max |difference| to float32 FMAs {diff:.4f}")
    if saved is None:
        os.environ.pop(flash_cpu.TILES_VAR)
    else:
        os.environ[flash_cpu.TILES_VAR] = saved


def kernel_vs_sdpa(length: int, reps: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """One layer: 16 query heads, 8 KV heads, head_dim 128, one causal sequence, in `dtype`."""
    from step15_flash_attention import amx_prefill
    from step15_flash_attention.flash_cpu import flash_attention_cpu
    Hq, Hkv, D, bs = 16, 8, 128, 16
    g = torch.Generator().manual_seed(0)
    nb = length // bs
    k_pool, v_pool = (torch.randn(nb, Hkv, bs, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(length, Hq, D, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[None]                  # scattered blocks, as in a real pool
    cu, lens = torch.tensor([0, length]), torch.tensor([length])
    # torch's SDPA wants contiguous [heads, L, D] K/V with the GQA heads repeated: built outside the timer.
    k = k_pool[tables[0]].transpose(1, 2).reshape(length, Hkv, D).repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
    v = v_pool[tables[0]].transpose(1, 2).reshape(length, Hkv, D).repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
    k, v, qh = k.contiguous()[None], v.contiguous()[None], q.transpose(0, 1).contiguous()[None]
    flops = 4 * Hq * D * length * length / 2                        # QK^T and PV, causal half
    results = {}
    variants = [("ours (paged, in place)", lambda: flash_attention_cpu(q, k_pool, v_pool, cu, lens, tables)),
                ("torch SDPA is_causal (contiguous K/V)",
                 lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=True))]
    if dtype == torch.bfloat16 and amx_prefill.amx_prefill_fits(q, k_pool):
        amx_out = torch.empty_like(q)
        variants.append(("ours on AMX tiles (amx_prefill.cpp)",
                         lambda: amx_prefill.amx_prefill(q, k_pool, v_pool, cu, lens, tables, amx_out) or amx_out))
    for name, fn in variants:
        fn()                                                        # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        secs = (time.perf_counter() - t0) / reps
        results[name] = (secs, out)
        print(f"{name:40s} {secs:7.3f} s per layer  {flops / secs / 1e9:6.1f} GFLOP/s")
    (a, oa), (b, ob) = list(results.values())[:2]
    diff = (oa.float() - ob[0].transpose(0, 1).float()).abs().max().item()
    print(f"ours / SDPA time: {a / b:.2f} (below 1 = ours faster), max |difference| {diff:.4f} ({dtype})")
    if len(results) == 3:
        c, oc = results["ours on AMX tiles (amx_prefill.cpp)"]
        print(f"AMX tiles / ours time: {c / a:.2f}, max |difference| {(oc.float() - oa.float()).abs().max().item():.4f}")
    elif dtype == torch.bfloat16:
        print("AMX tiles: not on this CPU (amx_prefill.cpp needs AMX; lesson 16's fast path keeps prompt rows "
              "on this kernel)")


def one_prefill(engine_name: str, length: int, budget: int) -> dict:
    """Run in a child process: load, then prefill one prompt of `length` random tokens."""
    from step04_transformer.loader import load_model
    model = load_model(random_qwen3_06b(), torch.bfloat16)
    build, options = ENGINES[engine_name]
    kv_bytes = 2 * 28 * 8 * 128 * 2 * (length + 64)                # the prompt's K/V plus a margin
    engine = build(model, PagedSchedulerConfig(max_num_seqs=1, max_num_batched_tokens=budget, kv_cache_bytes=kv_bytes),
                   **options)
    rng = torch.Generator().manual_seed(length)
    prompt = torch.randint(1000, QWEN3_06B_SHAPE["vocab_size"] - 1000, (length,), generator=rng).tolist()
    attention_secs = [0.0]
    make_attention = engine.make_attention

    def timed_attention(batch):           # the same step attention, its calls timed (K/V write + attention)
        attention = make_attention(batch)

        def call(*args):
            t = time.perf_counter()
            out = attention(*args)
            attention_secs[0] += time.perf_counter() - t
            return out
        return call
    engine.make_attention = timed_attention
    before = reset_peak_rss()         # after loading: the loader's own peak is not the prefill's
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    secs = time.perf_counter() - t0
    return dict(secs=secs, attention_secs=attention_secs[0], extra_rss=peak_rss() - before, steps=engine.num_steps,
                kv_bytes=2 * 28 * 8 * 128 * 2 * length, backend=getattr(engine, "attention", None) and engine.attention.name)


def prefill(lengths: list[int], budget: int, threads: int, skip14: bool) -> None:
    print(f"one prompt, chunked at max_num_batched_tokens={budget}; attention s = time inside the attention "
          f"backend (K/V write + attention, all layers); extra MB = peak RSS growth during the prefill over the "
          f"loaded model and its KV pool (zero-filled, so already resident); K/V MB = the prompt's K/V\n")
    print(f"{'tokens':>7} {'lesson':>6} {'seconds':>8} {'attention s':>12} {'prefill tok/s':>14} {'extra MB':>9} "
          f"{'K/V MB':>7}")
    for length in lengths:
        row = {}
        for name in ([] if skip14 else ["14"]) + ["15"]:
            cmd = [sys.executable, "-m", "step15_flash_attention.bench", "_one", name, str(length),
                   "--budget", str(budget), "--threads", str(threads)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{length:7d} {name:>6} failed:\n{res.stderr[-1500:]}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            row[name] = r
            print(f"{length:7d} {name:>6} {r['secs']:8.1f} {r['attention_secs']:12.1f} {length / r['secs']:14.1f} "
                  f"{r['extra_rss'] / 2**20:9.0f} {r['kv_bytes'] / 2**20:7.0f}", flush=True)
        if len(row) == 2:
            print(f"{'':7} lesson 15 / lesson 14 at {length} tokens: {row['14']['secs'] / row['15']['secs']:.2f}x "
                  f"faster prefill, {row['14']['attention_secs'] / row['15']['attention_secs']:.2f}x faster attention")


def run_workload(rounds: int, seed: int) -> None:
    from step04_transformer.loader import load_model
    model = load_model(random_qwen3_06b(), torch.bfloat16)
    prompts, outs = workload(64, seed, QWEN3_06B_SHAPE["vocab_size"])
    print(f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"outputs {min(outs)}-{max(outs)} (sum {sum(outs)}), ignore_eos; max_num_seqs=64, "
          f"max_num_batched_tokens=512; runs alternate\n")
    totals: dict[str, list[float]] = {"14": [], "15": []}
    for r in range(rounds):
        for name, (build, options) in ENGINES.items():
            secs, prefill_secs, engine = run_engine(model, prompts, outs, 64, 512, 6 * 2**30, engine_class=build,
                                                    **options)
            totals[name].append(secs)
            print(f"round {r + 1}, lesson {name}: {secs:6.1f} s, {sum(outs) / secs:6.1f} output tok/s, "
                  f"{prefill_secs:5.1f} s in steps with prompt tokens, {engine.num_steps} steps", flush=True)
    best14, best15 = min(totals["14"]), min(totals["15"])
    print(f"\nbest of {rounds}: lesson 14 {sum(outs) / best14:.1f}, lesson 15 {sum(outs) / best15:.1f} output tok/s "
          f"(lesson 15 / lesson 14 = {best14 / best15:.2f}x)")


def decode_rate(batch: int = 48, context: int = 400, block_size: int = 16, reps: int = 4) -> None:
    """The attention of one decode step of the Qwen3-0.6B shape (16 q heads, 8 KV heads, D 128,
    in the dtype the engine picks here): `batch` sequences of `context` tokens, their blocks at
    random places of a pool larger than the caches (as in a server that has been running a
    while), 28 layers of it."""
    import random
    from minivllm_support.cpu import auto_dtype
    from minivllm_support.workloads import read_bandwidth
    from step15_flash_attention.flash_cpu import flash_attention_cpu
    dtype = auto_dtype()
    per_seq = -(-context // block_size)
    pool_blocks = 4 * batch * per_seq                  # a quarter of it in use
    layers = [(torch.randn(pool_blocks, 8, block_size, 128).to(dtype), torch.randn(pool_blocks, 8, block_size, 128).to(dtype))
              for _ in range(4)]                   # 4 pools take turns as the 28 layers: 4 x 2 x 0.3 GB (bf16)
    where = random.Random(0).sample(range(pool_blocks), batch * per_seq)
    tables = torch.tensor(where).view(batch, per_seq)
    q, cu, lens = torch.randn(batch, 16, 128).to(dtype), torch.arange(batch + 1), torch.full((batch,), context)

    def step() -> None:
        for i in range(28):
            k, v = layers[i % len(layers)]
            flash_attention_cpu(q, k, v, cu, lens, tables, check=False)
    step()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    nbytes = batch * context * 28 * 2 * 8 * 128 * dtype.itemsize          # K and V, every layer
    rate = read_bandwidth()
    print(f"decode attention ({str(dtype).removeprefix('torch.')}), {batch} sequences x {context} tokens, "
          f"block size {block_size}, blocks scattered "
          f"over the pool, 28 layers (best of {reps}):")
    print(f"  {best * 1e3:.1f} ms a step, K/V read at {nbytes / best / 1e9:.1f} GB/s; this machine reads "
          f"{rate / 1e9:.1f} GB/s (a float32 sum): {nbytes / best / rate:.2f}x of it")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernel", "prefill", "workload", "decode", "_one"])
    p.add_argument("engine", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("length", nargs="?", type=int, help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--long", action="store_true", help="also a 32k-token prompt (prefill)")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (prefill)")
    p.add_argument("--kernel-length", type=int, default=8192)
    p.add_argument("--reps", type=int, default=2, help="timed calls per kernel (kernel)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (workload)")
    p.add_argument("--skip-lesson14", action="store_true", help="prefill: lesson 15 only")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.what == "_one":
        print(json.dumps(one_prefill(args.engine, args.length, args.budget)))
        return
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    if args.what == "kernel":
        from step15_flash_attention.flash_cpu import core_peaks
        fma, dot = core_peaks()
        print(f"one core's ceiling: float32 FMA {fma:.0f} GFLOP/s, bf16 dot product (vdpbf16ps) "
              + (f"{dot:.0f} GFLOP/s" if dot > 0 else "not available") + f"; {torch.get_num_threads()} threads")
        print("a 1024 -> 3072 linear over 512 tokens:")
        linear_rates()
        print()
        tile_paths(max(args.reps, 5), args.threads)
        for dtype in (torch.bfloat16, torch.float32):
            print(f"\none layer's attention, {dtype}:")
            kernel_vs_sdpa(args.kernel_length, args.reps, dtype)
    elif args.what == "decode":
        decode_rate(reps=max(args.reps, 4))
    elif args.what == "prefill":
        prefill(args.lengths + ([32768] if args.long else []), args.budget, args.threads, args.skip_lesson14)
    else:
        run_workload(args.rounds, args.seed)
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
