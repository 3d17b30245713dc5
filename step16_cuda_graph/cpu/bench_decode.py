"""`bench.py decode`: lesson 15's kernel on one decode step's attention (the Qwen3-0.6B shape:
16 query heads, 8 KV heads, head dim 128, in the dtype the engine picks here, 28 layers), its blocks scattered over a pool
larger than the caches as in a server that has run a while, the pool on 4 KB pages (lesson 14's)
and on 2 MB pages (huge_pages.py), in alternating rounds. Prints each one's K/V read rate
against this machine's plain read rate (a float32 sum). `bench.py weights`: the other read of a
small decode step, its weights, from copies on 4 KB and on 2 MB pages."""
from __future__ import annotations

import random
import statistics
import time

import torch

from minivllm_support.cpu import auto_dtype
from minivllm_support.workloads import read_bandwidth
from step15_flash_attention import flash_cpu
from step15_flash_attention.flash_cpu import flash_attention_cpu
from step16_cuda_graph.cpu.huge_pages import huge_page_bytes, huge_page_copy, huge_page_zeros
from step16_cuda_graph.cpu.ops import gemv, gemv_max_rows

LAYERS, HQ, HKV, D = 28, 16, 8, 128


def alternate(variants: dict, step, rounds: int) -> dict[str, list[float]]:
    """Seconds of step(v) for each variant, the variants taking turns, `rounds` times."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, v in variants.items():
            times[name].append(step(v))
    return times


def print_rates(times: dict[str, list[float]], nbytes: int, rate: float, what: str) -> None:
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name}: {med * 1e3:6.1f} ms a step (median; {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}), "
              f"{what} read at {nbytes / med / 1e9:5.1f} GB/s = {nbytes / med / rate:.2f}x the plain read rate")


def run_decode(batch: int = 48, context: int = 400, block_size: int = 16, rounds: int = 6) -> None:
    if flash_cpu.load() is None:
        print("lesson 15's kernel is unavailable here (no C++ compiler): nothing to measure")
        return
    per_seq = -(-context // block_size)
    pool_blocks = 4 * batch * per_seq                  # a quarter of it in use
    shape, dtype = (pool_blocks, HKV, block_size, D), auto_dtype()
    rand = lambda t: t.copy_(torch.randn(shape))      # noqa: E731
    before = huge_page_bytes()
    pools = {"4 KB pages": [(rand(torch.zeros(shape, dtype=dtype)), rand(torch.zeros(shape, dtype=dtype)))
                            for _ in range(4)],        # 4 pools take turns as the 28 layers (2.5 GB in all, bf16)
             "2 MB pages": [(rand(huge_page_zeros(shape, dtype)), rand(huge_page_zeros(shape, dtype)))
                            for _ in range(4)]}
    granted = huge_page_bytes() - before
    where = random.Random(0).sample(range(pool_blocks), batch * per_seq)
    tables = torch.tensor(where).view(batch, per_seq)
    q, cu, lens = torch.randn(batch, HQ, D).to(dtype), torch.arange(batch + 1), torch.full((batch,), context)
    out = torch.empty_like(q)

    def step(layers) -> float:
        t0 = time.perf_counter()
        for i in range(LAYERS):
            k, v = layers[i % len(layers)]
            flash_attention_cpu(q, k, v, cu, lens, tables, out=out, check=False)
        return time.perf_counter() - t0

    for layers in pools.values():
        step(layers)                                   # warm-up
    times = alternate(pools, step, rounds)
    nbytes = batch * context * LAYERS * 2 * HKV * D * dtype.itemsize          # K and V, every layer
    rate = read_bandwidth()
    print(f"decode attention ({str(dtype).removeprefix('torch.')}), {batch} sequences x {context} tokens, block size {block_size}, blocks scattered "
          f"over the pool, {LAYERS} layers; {rounds} alternating rounds; this machine reads {rate / 1e9:.1f} GB/s "
          f"(a float32 sum); huge pages granted: {granted / 2**30:.2f} of {sum(t.numel() * dtype.itemsize for kv in pools['2 MB pages'] for t in kv) / 2**30:.2f} GiB")
    print_rates(times, nbytes, rate, "K/V")


def run_weights(rounds: int = 9) -> None:
    """`bench.py weights`: a batch-1 decode step's weight reads alone, gemv_bf16 over the Qwen3-0.6B
    shape's plain bf16 weights (28 layers of q|k|v, o, gate|up, down, then the LM head: 1.19 GB),
    the copies on 4 KB pages and on 2 MB pages (huge_page_copy), in alternating rounds."""
    if gemv_max_rows() < 1:
        print("gemv_bf16 is not in this CPU's build (AVX-512 BF16 only): nothing to measure")
        return
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * LAYERS + [(151936, 1024)]
    before = huge_page_bytes()
    plain = [torch.randn(s).bfloat16() for s in shapes]
    copies = {"4 KB pages": plain, "2 MB pages": [huge_page_copy(w) for w in plain]}
    if any(w is None for w in copies["2 MB pages"]):
        print("this OS gives no 2 MB pages on request (madvise): nothing to compare")
        return
    granted = huge_page_bytes() - before
    x = {k: torch.randn(1, k).bfloat16() for k in {s[1] for s in shapes}}

    def step(weights) -> float:
        t0 = time.perf_counter()
        for w in weights:
            gemv(x[w.shape[1]], w)
        return time.perf_counter() - t0

    times = alternate(copies, step, rounds)
    nbytes = sum(w.numel() * 2 for w in plain)
    rate = read_bandwidth()
    print(f"batch-1 weight reads: gemv_bf16 over {len(shapes)} bf16 weights ({nbytes / 1e9:.2f} GB, Qwen3-0.6B shape "
          f"with its LM head); {rounds} alternating rounds; this machine reads {rate / 1e9:.1f} GB/s (a float32 sum); "
          f"huge pages granted: {granted / 2**30:.2f} GiB")
    print_rates(times, nbytes, rate, "weights")
