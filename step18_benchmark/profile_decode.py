"""Where a decode step's time goes on the Qwen3-0.6B shape: B sequences of `--context` tokens.

    python step18_benchmark/profile_decode.py --batch 64 --context 360
    python step18_benchmark/profile_decode.py --torch-only     # no C++ kernel, no packed weights
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import profile

from minivllm_support.cli import machine
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from minivllm_support.workloads import random_qwen3_06b
from step14_batched_forward.engine import BatchedEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=360)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torch-only", action="store_true", help="gather + matmul attention, unpacked weights")
    p.add_argument("--rows", type=int, default=6, help="ops shown in the profile table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"machine: {machine()}")
    model = load_model(random_qwen3_06b(), torch.bfloat16)
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())   # before packing
    linears = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))
    engine = BatchedEngine(model, PagedSchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=4096,
                                                      kv_cache_bytes=8 * 2**30),
                           use_kernel=not args.torch_only, pack_weights=not args.torch_only)
    for i in range(args.batch):
        engine.add_request([1000 + i] * args.context, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()                                   # prefill everything first
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    kv = args.batch * args.context * cfg.kv_bytes_per_token
    print(f"decode step, {args.batch} sequences x {args.context} tokens: {1e3 * min(times):.0f} ms "
          f"({args.batch / min(times):.0f} tok/s); bytes per step: weights {weights / 1e9:.2f} GB "
          f"(linear layers {linears / 1e9:.2f} GB, embedding (tied LM head) and norms {(weights - linears) / 1e9:.2f} GB), "
          f"KV {kv / 1e9:.2f} GB")
    with profile() as prof:
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
