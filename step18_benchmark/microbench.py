"""The small measurements lesson 14's README leans on, in one run (a few seconds).

    python step18_benchmark/microbench.py

1. how fast this machine reads memory (a sum over 2 GiB), the floor for a memory-bound step;
2. one bf16 linear, 3072 x 1024 weight, 64 rows: `F.linear` vs the pre-packed weight; then
   out of cache (12 such weights in turn, 75 MB bf16 / 150 MB float32) at 1, 8, 64 and 512
   rows, in the dtypes this CPU packs: the figures behind packing float32 too;
3. how long the kernel takes to build (into a temporary folder, not the cache);
4. the decode kernel for one layer of the Qwen3-0.6B shape, 64 sequences x 360 tokens: K/V
   blocks scattered through a large pool, then every sequence reading the same 8 blocks
   (they stay in the cache, so what is left is the arithmetic).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm_support.cli import machine
from step14_batched_forward import kernel
from step14_batched_forward.packed_linear import PackedLinear, can_pack


def per_call(fn, repeat: int) -> float:
    """Seconds per call, after three warm-up calls."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def linears_out_of_cache(rows_list=(1, 8, 64, 512), rounds: int = 3) -> None:
    """F.linear vs packed over 12 weights of 3072 x 1024 in turn (more than the caches hold),
    the two taking turns `rounds` times; the best round of each."""
    for dtype in (torch.float32, torch.bfloat16):
        if not can_pack(dtype):
            print(f"linears out of cache, {dtype}: not packed on this CPU")
            continue
        weights = [(torch.randn(3072, 1024) * 0.02).to(dtype) for _ in range(12)]
        packed = [PackedLinear(torch.nn.Linear(1024, 3072, bias=False, dtype=dtype)) for _ in range(12)]
        print(f"linears out of cache, {dtype}, 12 x (3072 x 1024), ms for all 12 (best of {rounds}, in turns):")
        for rows in rows_list:
            x = torch.randn(rows, 1024).to(dtype)
            best = {"F.linear": float("inf"), "packed": float("inf")}
            for _ in range(rounds):
                best["F.linear"] = min(best["F.linear"], per_call(lambda: [F.linear(x, w) for w in weights], 5))
                best["packed"] = min(best["packed"], per_call(lambda: [lin(x) for lin in packed], 5))
            print(f"  {rows:4d} rows: F.linear {best['F.linear'] * 1e3:7.2f}, packed {best['packed'] * 1e3:7.2f}"
                  f"  ({best['F.linear'] / best['packed']:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"machine: {machine()}")

    big = torch.ones(2**30, dtype=torch.bfloat16)
    bandwidth = big.numel() * 2 / per_call(big.sum, 5)
    del big
    print(f"memory read (sum over 2 GiB): {bandwidth / 1e9:.1f} GB/s")

    lin = torch.nn.Linear(1024, 3072, bias=False).to(torch.bfloat16)
    x = torch.randn(64, 1024).to(torch.bfloat16)
    plain = per_call(lambda: F.linear(x, lin.weight), 200)
    line = f"linear 3072x1024 bf16, 64 rows: F.linear {plain * 1e3:.2f} ms"
    if can_pack(torch.bfloat16):
        packed = PackedLinear(lin)
        line += f", packed {per_call(lambda: packed(x), 200) * 1e3:.2f} ms"
    print(line)     # a best case: called again and again, the 6 MB weight may stay in the cache
    linears_out_of_cache()

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        try:
            kernel._build(Path(tmp) / "paged_decode.so")
            print(f"kernel build: {time.perf_counter() - t0:.2f} s")
        except RuntimeError as e:
            print(f"kernel build failed: {e}")
    if kernel.load() is None:
        return

    B, Hkv, group, bs, D, L = 64, 8, 2, 16, 128, 360
    nblk = -(-L // bs)
    pool_blocks = B * nblk + 64
    k_pool = torch.randn(pool_blocks, Hkv, bs, D).to(torch.bfloat16)
    v_pool = torch.randn(pool_blocks, Hkv, bs, D).to(torch.bfloat16)
    q = torch.randn(B, Hkv * group, D).to(torch.bfloat16)
    lens = torch.full((B,), L)
    scores = torch.empty(B * Hkv * group * nblk * bs)
    kv_bytes = 2 * B * L * Hkv * D * 2
    tables = {"scattered blocks": torch.randperm(pool_blocks)[:B * nblk].view(B, nblk),
              "same 8 blocks (cached)": (torch.arange(B * nblk) % 8).view(B, nblk)}
    for name, table in tables.items():
        secs = per_call(lambda: kernel.paged_decode_attention(q, k_pool, v_pool, table, lens, scores), 40)
        print(f"decode kernel, one layer, {B} seqs x {L} tokens, {name}: {secs * 1e3:.2f} ms "
              f"({kv_bytes / secs / 1e9:.1f} GB/s of K/V)")


if __name__ == "__main__":
    main()
