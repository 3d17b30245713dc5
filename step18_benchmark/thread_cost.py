"""What running the engine loop in a second thread costs: the same work timed in the main
thread and in a new thread, as the async front end (frontend.py) runs it.

    python step18_benchmark/thread_cost.py

Two measurements, each main thread first, then a fresh thread:
  - one bf16 linear (64 x 576 -> 1536, a SmolLM2 MLP shape), oneDNN's matmul;
  - lesson 16's engine on 8 requests x 64 tokens (the embedded model, compiled decode steps).
"""
from __future__ import annotations

import threading
import time

import torch

from minivllm_support.cli import machine
from minivllm_support.models import embedded_smollm2
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.engine import GraphEngine


def in_new_thread(fn):
    out = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


def linear_us(x, w, n: int = 300) -> float:
    for _ in range(10):
        torch.nn.functional.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    print(f"machine: {machine()}")
    x, w = torch.randn(64, 576).bfloat16(), torch.randn(1536, 576).bfloat16()
    print(f"bf16 linear 64 x 576 -> 1536: main thread {linear_us(x, w):.0f} us, "
          f"new thread {in_new_thread(lambda: linear_us(x, w)):.0f} us")
    engine = GraphEngine(load_model(embedded_smollm2(), torch.bfloat16),
                         PagedSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512,
                                              kv_cache_bytes=512 * 2**20))
    prompts = [[1 + (i * 7 + j) % 4000 for j in range(60)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def ms_per_step() -> float:
        steps, t0 = engine.num_steps, time.perf_counter()
        engine.generate(prompts, params)
        return (time.perf_counter() - t0) / (engine.num_steps - steps) * 1e3

    ms_per_step()                                                   # warm-up
    main_ms, thread_ms = ms_per_step(), in_new_thread(ms_per_step)
    print(f"lesson 16, 8 requests x 64 tokens: main thread {main_ms:.1f} ms a step, "
          f"new thread {thread_ms:.1f} ms a step ({thread_ms / main_ms:.2f}x)")


if __name__ == "__main__":
    main()
