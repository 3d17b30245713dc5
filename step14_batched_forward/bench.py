"""Throughput on the Qwen3-0.6B shape: lesson 14's engine vs Hugging Face `generate`, one run.

Random weights (no checkpoint is needed to measure speed): 28 layers, hidden 1024, 16 heads,
8 KV heads, head_dim 128, vocab 151936, tied embeddings; stored in bf16, run in --dtype (auto:
bf16 where the CPU computes bf16 natively, else fp32). The workload: prompts of 64-512
random token ids and 64-256 output tokens with ignore_eos, from a fixed seed.

    python step14_batched_forward/bench.py --threads 2
    python step14_batched_forward/bench.py --ladder      # also lesson 14 without kernel / packing
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from minivllm_support.cli import DTYPES, machine, resolve_dtype_name
from minivllm_support.models import cache_dir
from minivllm_support.workloads import QWEN3_06B_SHAPE, random_qwen3_06b, workload
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine

def run_engine(model, prompts, outs, max_num_seqs: int, budget: int, kv_bytes: int,
               engine_class: type = BatchedEngine, **options) -> tuple[float, float, BatchedEngine]:
    """Total seconds, seconds spent in steps that computed prompt tokens, and the engine."""
    engine = engine_class(model, PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                      kv_cache_bytes=kv_bytes), **options)
    t0 = time.perf_counter()
    for p, m in zip(prompts, outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    prefill_secs = 0.0
    while engine.has_unfinished():          # engine.generate's loop, with the prefill steps timed
        before, t = engine.prompt_tokens, time.perf_counter()
        engine.step()
        if engine.prompt_tokens > before:
            prefill_secs += time.perf_counter() - t
    return time.perf_counter() - t0, prefill_secs, engine


def run_hf(hf, prompts, outs, batch: int) -> float:
    """Left-padded batches in arrival order; a batch runs until its longest request is done."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, ms = prompts[i:i + batch], outs[i:i + batch]
        L = max(map(len, ps))
        ids = torch.tensor([[0] * (L - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ms), min_new_tokens=max(ms),
                    do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--hf-requests", type=int, default=16, help="requests given to HF generate (a prefix of the same list)")
    p.add_argument("--hf-batch", type=int, nargs="+", default=[16])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--kv-gib", type=float, default=6.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="only HF generate (to search its best batch size)")
    p.add_argument("--ladder", action="store_true",
                   help="first run lesson 14 in plain torch, then with the kernel only (adds ~5 min)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    dtype_name = resolve_dtype_name(args.dtype)
    dtype = DTYPES[dtype_name]
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}\ndtype: {dtype_name}")
    path = random_qwen3_06b()
    from step04_transformer.loader import load_model
    model = load_model(path, dtype)
    prompts, outs = workload(args.requests, args.seed, QWEN3_06B_SHAPE["vocab_size"])
    print(f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens (sum {sum(map(len, prompts))}), outputs {min(outs)}-{max(outs)} (sum {sum(outs)}), ignore_eos\n")

    variants = [] if args.skip_engine else [("lesson 14 engine", {})]
    if args.ladder and not args.skip_engine:     # packing changes the model in place, so the packed run comes last
        variants = [("lesson 14, torch only    ", dict(use_kernel=False, pack_weights=False)),
                    ("lesson 14, + decode kernel", dict(pack_weights=False)),
                    ("lesson 14, + packed weights", {})]
    for name, options in variants:
        secs, prefill_secs, engine = run_engine(model, prompts, outs, args.max_num_seqs, args.budget,
                                                int(args.kv_gib * 2**30), **options)
        ours = sum(outs) / secs
        print(f"{name}: {secs:7.1f} s, {ours:6.1f} output tok/s  ({engine.num_steps} steps, "
              f"{prefill_secs:.1f} s of them in steps with prompt tokens; max_num_seqs={args.max_num_seqs}, "
              f"max_num_batched_tokens={args.budget}, preemptions={engine.scheduler.num_preemptions}, "
              f"kernel={engine.use_kernel}, packed linears={engine.num_packed})")
    if args.skip_hf:
        return
    engine = None
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    n = min(args.hf_requests, len(prompts))
    best = 0.0
    for b in args.hf_batch:
        secs = run_hf(hf, prompts[:n], outs[:n], b)
        tps = sum(outs[:n]) / secs
        best = max(best, tps)
        print(f"HF generate, batch {b:3d}, first {n} requests: {secs:7.1f} s, {tps:6.1f} output tok/s")
    if args.skip_engine:
        return
    print(f"\nlesson 14 / best HF: {ours / best:.1f}x   (load average at the end: "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
