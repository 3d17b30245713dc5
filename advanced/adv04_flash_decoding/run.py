"""Advanced lesson 04: flash-decoding (split-KV) against lesson 15's decode, one attention layer.

    python advanced/adv04_flash_decoding/run.py                     # about a minute
    python advanced/adv04_flash_decoding/run.py --threads 2 --repeats 5

Random K/V of the Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, bf16,
blocks of 16 tokens) in one shuffled paged pool of 2 GiB. Every call reads blocks the previous
calls did not touch (the tables rotate through the whole pool), as 28 layers would: each layer
has its own K/V, so no cache holds them between a layer's calls. Times are medians of calls
taking turns (minivllm_support.timing.compare). Then the same with one KV head (what one rank
of an 8-way tensor-parallel Qwen3 holds), and a sweep of split sizes.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from advanced.adv04_flash_decoding.flash_decode_cpu import flash_decode_cpu, load
from advanced.adv04_flash_decoding.flash_decode_torch import flash_decode_torch
from advanced.adv04_flash_decoding.splits import BALANCE, MIN_SPLIT, choose_split_size, splits_per_sequence
from minivllm_support.cli import machine
from minivllm_support.timing import Timing, compare, format_ratio
from step15_flash_attention.flash_cpu import flash_attention_cpu
from step15_flash_attention.reference import random_paged_case, reference_attention

HQ, HKV, D, BS = 16, 8, 128, 16          # Qwen3-0.6B attention; lesson 12's block size, used by lesson 15
POOL_TOKENS = 16 * 32768                  # enough for the largest batch: 16 sequences of 32k
MIN_RUN_BYTES = 256 * 2**20               # a timed run repeats small calls until it reads this much


def read_bandwidth(repeats: int) -> tuple[float, float]:
    """Bytes per second of a float32 sum over 2 GiB (more than any L3 here), on one thread and on all."""
    big, threads = torch.ones(2**29), torch.get_num_threads()

    def on(n: int):
        def go():
            torch.set_num_threads(n)
            try:
                return big.sum()
            finally:
                torch.set_num_threads(threads)
        return go
    t = compare({"one": on(1), "all": on(threads)}, repeats=repeats)
    return big.numel() * 4 / t["one"].median, big.numel() * 4 / t["all"].median


def make_pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools [POOL_TOKENS / BS, HKV, BS, D]: a random 32 MiB piece repeated (randn of 2 GiB is slow)."""
    g = torch.Generator().manual_seed(0)
    pools = []
    for _ in range(2):
        piece = torch.randn(1024, HKV, BS, D, generator=g).to(dtype)
        pool = torch.empty(POOL_TOKENS // BS, HKV, BS, D, dtype=dtype)
        pool.view(-1, *piece.shape).copy_(piece.expand(pool.shape[0] // 1024, *piece.shape))
        pools.append(pool)
    return pools[0], pools[1]


def table_sets(num_blocks: int, batch: int, context: int) -> list[torch.Tensor]:
    """As many disjoint [batch, blocks] tables as the pool holds, each a random scatter of blocks."""
    per_set = batch * (-(-context // BS))
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(batch * context))
    return [perm[i * per_set:(i + 1) * per_set].view(batch, -1) for i in range(num_blocks // per_set)]


def bytes_per_call(lens: list[int], hq: int, hkv: int, elem: int, split: int | None) -> int:
    """What one call must move: K/V of every key, q and out, the tables, and the splits' partial results."""
    kv = 2 * sum(lens) * hkv * D * elem
    tables = sum(-(-n // BS) for n in lens) * 8
    parts = 0
    if split is not None:                 # written by the split loop, read back by the merge
        parts = sum(s for s in splits_per_sequence(lens, split) if s > 1) * hq * (D + 1) * 4 * 2
    return kv + 2 * len(lens) * hq * D * elem + tables + parts


def timed_variants(k_pool, v_pool, q, batch: int, context: int, variants: dict[str, int | None],
                   repeats: int) -> tuple[dict[str, Timing], int, float]:
    """Time lesson 15 (split None) and our kernel at each split size; returns timings, calls per run, max diff."""
    tables = itertools.cycle(table_sets(k_pool.shape[0], batch, context))
    cu, lens = torch.arange(batch + 1), torch.full((batch,), context)
    calls = max(1, MIN_RUN_BYTES // bytes_per_call([context] * batch, q.shape[1], k_pool.shape[1], 2, None))

    def run(split: int | None):
        def go():
            for _ in range(calls):
                t = next(tables)
                if split is None:
                    out = flash_attention_cpu(q, k_pool, v_pool, cu, lens, t, check=False)
                else:
                    out = flash_decode_cpu(q, k_pool, v_pool, cu, lens, t, split_size=split, check=False)
            return out, t
        return go
    timings = compare({name: run(split) for name, split in variants.items()}, repeats=repeats)
    out, t = timings["lesson 15"].result              # its last call's tables: recompute the others on them
    diff = max((flash_decode_cpu(q, k_pool, v_pool, cu, lens, t, split_size=s, check=False).float()
                - out.float()).abs().max().item() for s in variants.values() if s is not None)
    return timings, calls, diff


def table(k_pool, v_pool, hq: int, configs: list[tuple[int, int]], bandwidth: float, repeats: int,
          threads: int) -> None:
    hkv = k_pool.shape[1]
    g = torch.Generator().manual_seed(1)
    print(f"{'batch':>5} {'context':>7}  {'variant':<30} {'items':>6} {'ms a call':>9} {'(range)':>17} "
          f"{'GB/s':>6} {'of bw':>6}  lesson 15 time / ours")
    for batch, context in configs:
        q = torch.randn(batch, hq, D, generator=g).to(k_pool.dtype)
        lens = [context] * batch
        here = choose_split_size(lens, hkv, threads, BS)
        big = choose_split_size(lens, hkv, 64, BS)
        n_here, n_big = splits_per_sequence(lens, here)[0], splits_per_sequence(lens, big)[0]
        variants = {"lesson 15": None, f"ours, rule here: {n_here} split{'s' * (n_here > 1)}": here,
                    f"ours, rule for 64 threads: {n_big}": big}
        timings, calls, diff = timed_variants(k_pool, v_pool, q, batch, context, variants, repeats)
        base = timings["lesson 15"]
        for (name, split), t in zip(variants.items(), timings.values()):
            nbytes = bytes_per_call(lens, hq, hkv, k_pool.element_size(), split)
            items = batch * hkv * (1 if split is None else splits_per_sequence(lens, split)[0])
            med, lo, hi = (x / calls * 1e3 for x in (t.median, min(t.seconds), max(t.seconds)))
            ratio = "" if split is None else format_ratio(base, t)
            rate = nbytes / (t.median / calls)
            print(f"{batch:5d} {context:7d}  {name:<30} {items:6d} {med:9.2f} {f'({lo:.2f}-{hi:.2f})':>17} "
                  f"{rate / 1e9:6.1f} {rate / bandwidth:6.0%}  {ratio}")
        print(f"{'':14}max |ours - lesson 15| = {diff:.1e} (bf16 outputs); {calls} call(s) per timed run")


def sweep(k_pool, v_pool, context: int, repeats: int) -> None:
    """One sequence, one KV head: split sizes from 'none' to one block per split."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, D, generator=g).to(k_pool.dtype)
    sizes = [context, context // 2, context // 8, 1024, MIN_SPLIT, 64, BS]
    variants = {"lesson 15": None} | {f"{context // s} splits of {s}": s for s in sizes}
    timings, calls, _ = timed_variants(k_pool, v_pool, q, 1, context, variants, repeats)
    base = timings["lesson 15"]
    for name, t in timings.items():
        line = "" if name == "lesson 15" else format_ratio(base, t)
        print(f"  {name:24} {t.median / calls * 1e3:7.2f} ms  {line}")


def rule_elsewhere(threads: int) -> None:
    """What the rule picks for the Qwen3-0.6B shape here, on a 64-core CPU and on a 132-SM GPU (computed)."""
    machines = [(f"this CPU ({threads} threads)", HKV, threads), ("a 64-core CPU", HKV, 64),
                ("a GPU with 132 SMs (Triton: items per query head)", HQ, 132)]
    print("the rule's splits per sequence for the Qwen3-0.6B shape (computed, not measured), "
          "contexts 4096 / 16384 / 32768:")
    for name, heads, workers in machines:
        cells = []
        for batch in (1, 4, 16):
            n = [splits_per_sequence([c], choose_split_size([c] * batch, heads, workers, BS))[0]
                 for c in (4096, 16384, 32768)]
            cells.append(f"batch {batch}: {'/'.join(map(str, n))}")
        print(f"  {name:52} {', '.join(cells)}")


def check(dtype: torch.dtype) -> None:
    """A small mixed batch against lesson 15's float32 reference: lengths off the block and split grid."""
    case = random_paged_case([1] * 4, [1, 37, 300, 1000], 2, 2, BS, D, dtype, seed=3)
    ref = reference_attention(*case)
    c = (flash_decode_cpu(*case, split_size=64).float() - ref).abs().max().item()
    t = (flash_decode_torch(*case, split_size=64).float() - ref).abs().max().item()
    print(f"  {str(dtype):15} C++ kernel {c:.1e}, torch version {t:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each variant, taking turns")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    threads = torch.get_num_threads()
    print(f"machine: {machine()}")
    if load() is None:
        print("the C++ kernel could not be built (see the warning): nothing to measure")
        return
    print("max |out - float32 reference|, 4 decodes of 1, 37, 300 and 1000 keys, splits of 64 keys:")
    check(torch.float32)
    check(torch.bfloat16)
    one, bandwidth = read_bandwidth(args.repeats)
    print(f"\nmemory read bandwidth (float32 sum over 2 GiB): {one / 1e9:.1f} GB/s on 1 thread, "
          f"{bandwidth / 1e9:.1f} GB/s on {threads} threads (\"bw\" below)")
    print(f"split rule (splits.py): share = kv_heads x sum(lens) / threads; split = max({MIN_SPLIT}, "
          f"share / {BALANCE}) keys, whole blocks;\n  no split once batch x kv_heads >= {BALANCE} x threads "
          f"= {BALANCE * threads} here, {BALANCE * 64} on 64 threads")

    rule_elsewhere(threads)

    k_pool, v_pool = make_pool(torch.bfloat16)
    print(f"\n== Qwen3-0.6B attention ({HQ} query heads, {HKV} KV heads, head_dim {D}, bf16, blocks of {BS}), "
          f"one layer, one decode per sequence")
    print("   GB/s = bytes a call must read or write (K/V of every key, q, out, tables, partial results) / time;"
          " of bw = share of the bandwidth above")
    table(k_pool, v_pool, HQ, [(b, c) for b in (1, 4, 16) for c in (4096, 16384, 32768)], bandwidth,
          args.repeats, threads)

    k1, v1 = (pool.view(-1, 1, BS, D) for pool in (k_pool, v_pool))   # the same memory, one KV head per block
    print(f"\n== one KV head, 2 query heads (one rank of Qwen3-0.6B at tensor parallel 8): batch x kv_heads "
          f"below {threads} threads is where splitting pays")
    table(k1, v1, 2, [(1, 4096), (1, 16384), (1, 32768), (2, 32768), (4, 32768)], bandwidth, args.repeats, threads)

    print("\n== split size, one KV head, batch 1, 32768 keys")
    sweep(k1, v1, 32768, args.repeats)


if __name__ == "__main__":
    main()
