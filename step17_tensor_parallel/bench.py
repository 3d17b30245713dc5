"""Lesson 17 measured on the Qwen3-0.6B shape (random weights, bf16).

    python step17_tensor_parallel/bench.py allreduce   # one all-reduce of [rows, 1024] bf16 between
                                                        # 2 processes: gloo vs shared memory
    python step17_tensor_parallel/bench.py step        # one decode step at batch 1 and 64 (context
                                                        # ~256): TP=1 with 2 threads, TP=2 with 1 thread
                                                        # per rank (gloo, shm); time in all-reduce, bytes
                                                        # sent, memory per rank

Each TP=2 engine takes turns with a TP=1 engine (rank 0's thread count is set for each turn:
2 for TP=1, 1 for TP=2); the best turn is shown. Do not run anything else meanwhile.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm_support.cli import machine
from step12_paged_attention.scheduler import PagedSchedulerConfig
from minivllm_support.workloads import random_qwen3_06b
from minivllm_support.workloads import time_steps
from step16_cuda_graph.decode_timing import fill
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import TPEngine
from step17_tensor_parallel.shm_allreduce import ShmAllReduce, create_file

VARIANTS = {  # name: (tensor_parallel_size, all_reduce, rank 0's threads)
    "TP=1, 2 threads": (1, "auto", 2),
    "TP=2 gloo, 1+1": (2, "gloo", 1),
    "TP=2 shm, 1+1": (2, "shm", 1),
}


# ---- one all-reduce, alone -----------------------------------------------------------------
def _allreduce_rank(rank: int, port: int, path: str, rows_list: list[int], hidden: int, out) -> None:
    torch.set_num_threads(1)
    store = parallel.make_store(rank, 2, port, 60)
    parallel.init_group(store, rank, 2, 60)
    shm = ShmAllReduce(path, rank, 2, max(rows_list) * hidden, 60, lambda: True)
    calls = {"gloo": dist.all_reduce, "shm": shm}
    results = {}
    for rows in rows_list:
        x = torch.ones(rows, hidden, dtype=torch.bfloat16)
        for name, all_reduce in calls.items():
            n = 2000 if name == "shm" else 300
            for _ in range(50):
                all_reduce(x.fill_(1))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                all_reduce(x)
            results[(rows, name)] = (time.perf_counter() - t0) / n
    if rank == 0:
        out.put(results)
    dist.barrier()
    shm.close()
    parallel.close_group()


def run_allreduce(rows_list: list[int], hidden: int = 1024) -> None:
    path = create_file(2, max(rows_list) * hidden)
    store = parallel.make_store(0, 1, 0, 10)          # only to find a free port
    port = store.port
    del store
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, path, rows_list, hidden, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join()
    os.unlink(path)
    print(f"one all-reduce (sum) of [rows, {hidden}] bf16 between 2 processes, 1 thread each")
    for rows in rows_list:
        g, s = results[(rows, "gloo")], results[(rows, "shm")]
        print(f"  {rows:4d} rows ({rows * hidden * 2 / 1024:6.0f} KiB): gloo {g * 1e6:7.1f} us, "
              f"shared memory {s * 1e6:6.1f} us  ({g / s:.1f}x)")


# ---- decode steps --------------------------------------------------------------------------
def build(name: str, kv_gib_tp1: float, max_num_seqs: int) -> TPEngine:
    tp, all_reduce, threads = VARIANTS[name]
    config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                  kv_cache_bytes=int(kv_gib_tp1 * 2**30 / tp))   # the same blocks at every tp
    return TPEngine(random_qwen3_06b(), config, tensor_parallel_size=tp, all_reduce=all_reduce,
                    threads_per_rank=threads, use_graph=False)


def timed_turns(engines: dict[str, TPEngine], steps: int, rounds: int) -> dict[str, tuple]:
    """Best (ms a step, ms in collectives, collectives, bytes sent by rank 0) of each engine, in turns."""
    best: dict[str, tuple[float, float, float, float]] = {}
    for _ in range(rounds):
        for name, e in engines.items():
            torch.set_num_threads(VARIANTS[name][2])
            parallel.COMM.reset()
            ms = time_steps(e, steps)
            c = parallel.COMM
            row = (ms, c.seconds * 1e3 / steps, c.calls / steps, c.bytes / steps)
            if name not in best or ms < best[name][0]:
                best[name] = row
    return best


def run_step(batches: list[int], context: int, rounds: int) -> None:
    """A process holds one TP>1 engine at a time (one default process group), so each TP=2
    variant takes turns with the same TP=1 engine, then makes room for the next."""
    print(f"one decode step, context ~{context} tokens; each TP=2 engine takes turns with TP=1, {rounds} rounds, "
          f"best round; all eager (lesson 16's compiled step is off under TP)")
    memory_shown = False
    for b in batches:
        steps = max(4, 32 // b)
        tp1 = build("TP=1, 2 threads", 2.5, b)
        torch.set_num_threads(2)
        fill(tp1, b, context, max_tokens=2 * (rounds + 1) * steps + 8)
        print(f"batch {b}:")
        for name in ("TP=2 gloo, 1+1", "TP=2 shm, 1+1"):
            e = build(name, 2.5, b)
            if not memory_shown:
                for n, eng in (("TP=1", tp1), ("TP=2", e)):
                    per = ", ".join(f"rank {r}: weights {m['weight_bytes'] / 2**20:.0f} MiB + KV pool "
                                    f"{m['kv_bytes'] / 2**20:.0f} MiB" for r, m in enumerate(eng.rank_memory))
                    print(f"  memory {n}: {per} ({eng.kv_pool.num_blocks} blocks)")
                memory_shown = True
            torch.set_num_threads(1)
            fill(e, b, context, max_tokens=(rounds + 1) * steps + 8)
            best = timed_turns({"TP=1, 2 threads": tp1, name: e}, steps, rounds)
            e.close()
            base = best["TP=1, 2 threads"][0]
            ms, comm_ms, calls, nbytes = best[name]
            print(f"  {name:16s} {ms:7.1f} ms a step vs TP=1 {base:7.1f} ms ({base / ms:.2f}x); collectives "
                  f"{comm_ms:5.1f} ms a step ({calls:.0f} calls, {nbytes / 1024:.0f} KiB from rank 0)")
        tp1.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["allreduce", "step"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    if args.what == "allreduce":
        run_allreduce(args.rows)
    else:
        run_step(args.batches, args.context, args.rounds)
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
