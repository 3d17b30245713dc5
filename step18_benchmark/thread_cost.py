"""What running the engine loop in a second thread costs: the same work timed in the main
thread and in a new thread, as the async front end (frontend.py) runs it.

    python step18_benchmark/thread_cost.py

Two measurements, the two variants taking turns after a warm-up (minivllm_support's
`compare`); each "new thread" run starts a fresh thread, both in this CPU's auto dtype (bf16
where it multiplies bf16, else float32):
  - one linear (64 x 576 -> 1536, a SmolLM2 MLP shape), oneDNN's matmul;
  - lesson 16's fast-path engine on 8 requests x 64 tokens (the embedded model, compiled decode steps).
"""
from __future__ import annotations

import threading

import torch

from minivllm_support.cli import DTYPES, machine, resolve_dtype_name
from minivllm_support.models import embedded_smollm2
from minivllm_support.timing import compare, format_ratio
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine


def in_new_thread(fn):
    """fn() run in a fresh thread (as AsyncEngine's engine thread is), its result returned."""
    out = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


def main() -> None:
    print(f"machine: {machine()}")
    name = resolve_dtype_name("auto")               # bf16 or fp32, as every run.py prints it
    dtype = DTYPES[name]
    x, w = torch.randn(64, 576).to(dtype), torch.randn(1536, 576).to(dtype)

    def linears(n: int = 300) -> None:
        for _ in range(n):
            torch.nn.functional.linear(x, w)
    t = compare({"main": linears, "thread": lambda: in_new_thread(linears)}, repeats=5)
    print(f"{name} linear 64 x 576 -> 1536: main thread {t['main'].median / 300 * 1e6:.0f} us, "
          f"new thread {t['thread'].median / 300 * 1e6:.0f} us ({format_ratio(t['thread'], t['main'], 'slower')})")
    engine = build_engine(load_model(embedded_smollm2(), dtype),
                          PagedSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512,
                                               kv_cache_bytes=512 * 2**20))
    prompts = [[1 + (i * 7 + j) % 4000 for j in range(60)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def generate() -> int:
        steps = engine.num_steps
        engine.generate(prompts, params)
        return engine.num_steps - steps
    t = compare({"main": generate, "thread": lambda: in_new_thread(generate)}, repeats=3)
    steps = t["main"].result
    print(f"lesson 16's fast path, 8 requests x 64 tokens ({steps} steps): main thread {t['main'].median / steps * 1e3:.1f} ms "
          f"a step, new thread {t['thread'].median / steps * 1e3:.1f} ms a step "
          f"({format_ratio(t['thread'], t['main'], 'slower')})")


if __name__ == "__main__":
    main()
