"""Advanced lesson 08: data-parallel replicas behind a router, on a multi-turn chat with shared
system prompts: prefix hit rate, TTFT/E2EL and throughput per routing policy at equal load, a
fitted prefill cost model that predicts the TTFT saving of a hit rate (checked on a second
workload), and one engine on all the cores for comparison.

The replicas may span machines (--nnodes/--node-rank/--master-addr/--master-port: this is node 0,
the others run `python -m advanced.adv08_data_parallel.node`) or be torchrun's ranks (rank 0 runs
this, every other rank turns into a replica: nnodes x nproc-per-node = --replicas + 1)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from advanced.adv08_data_parallel.frontend import DPFrontEnd
from advanced.adv08_data_parallel.node import run_torchrun_replica
from advanced.adv08_data_parallel.workload import chat_workload, run_chat, send_turn
from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from minivllm_support.timeline import busy_fraction, draw_png, write_chrome_trace
from minivllm_support.timing import busy_warning
from step04_transformer.config import ModelConfig
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from step18_benchmark.frontend import AsyncEngine
from step18_benchmark.metrics import summarize
from step19_real_model.engine import LogprobsEngine

POLICIES = [("round_robin", {}), ("least_load", {"tie_break": "rotate"}), ("cache_aware", {})]


@dataclass
class Row:
    name: str
    hit_rate: float              # prompt tokens found in a replica's prefix cache / looked up
    computed_per_req: float      # prompt tokens each request had to prefill, on average
    result: object               # lesson 18's ServingResult
    routed: list[int]
    busy: list[float]            # share of the run each replica spent in engine steps
    timelines: list = field(default_factory=list)


class OneEngine:
    """The comparison: one engine in this process on all the threads, served as lessons 18 and
    21 serve it (AsyncEngine, engine loop in the main thread), with the replicas' interface."""

    def __init__(self, folder, dtype, kv_cache_bytes: int, threads: int):
        # The replicas' scheduler settings (DPFrontEnd's defaults), so only the parallelism differs.
        config = PagedSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_bytes=kv_cache_bytes)
        self.engine = LogprobsEngine(folder, config, dtype=dtype, threads_per_rank=threads, use_graph=False)
        self.front = AsyncEngine(self.engine, threaded=False)

    def replica_stats(self) -> list:
        return [self.engine.stats()]

    def routed(self) -> list[int]:
        return [0]                                           # one engine: nothing is routed

    def close(self) -> None:
        self.front.shutdown()
        self.engine.close()


def measure(front, name: str, args, vocab: int, seed: int, user_len: int | None = None) -> Row:
    """The chat workload, `args.repeats` times pooled. Each run draws fresh tokens (seed): nothing
    an earlier run left in a cache can hit; arrival times (seed 0) and every length stay the same."""
    one = isinstance(front, OneEngine)
    engine_side = front.front if one else front
    if not one:
        front.timelines()                                   # (clears what earlier runs recorded)
    records, duration, before, routed = [], 0.0, front.replica_stats(), front.routed()
    for r in range(args.repeats):
        convs = chat_workload(args.conversations, args.turns, args.systems, args.system_len,
                              user_len or args.user_len, vocab, seed + 1000 * r)
        def go(convs=convs):
            return run_chat(engine_side, convs, args.rate, args.max_tokens, seed=0)
        run = go() if engine_side.threaded else engine_side.drive(go)
        records, duration = records + run.records, duration + run.duration_s
    after = front.replica_stats()

    def delta(field: str) -> int:
        return sum(getattr(a, field) - (getattr(b, field) if b else 0) for a, b in zip(after, before) if a)
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} request(s) failed, first: {failed[0]}")
    hits, queries = delta("prefix_cache_hits"), delta("prefix_cache_queries")
    routed = [len(records)] if one else [a - b for a, b in zip(front.routed(), routed)]
    timelines = [] if one else front.timelines()
    win = (int(min(r.start for r in records) * 1e9), int(max(r.end for r in records) * 1e9))
    busy = [busy_fraction(tl, win=win) for tl in timelines]
    return Row(name, hits / max(1, queries), delta("prompt_tokens") / len(records),
               summarize(records, duration), routed, busy, timelines)


def calibrate(front: DPFrontEnd, vocab: int, lengths=(64, 192, 384)) -> tuple[float, float]:
    """TTFT of a lone request = a + b x (prompt tokens it computes): each length once cold, then
    again with the same prompt + 8 tokens (a cache hit on the replica that holds it)."""
    rng, xs, ys = np.random.default_rng(7), [], []

    async def one(prompt):
        computed = sum(s.prompt_tokens for s in front.replica_stats() if s)
        rec, _ = await send_turn(front, prompt, 1)
        xs.append(sum(s.prompt_tokens for s in front.replica_stats() if s) - computed)
        ys.append(rec.ttft)

    async def run_all():
        for n in lengths:
            prompt = rng.integers(10, vocab, n).tolist()
            await one(prompt)
            await one(prompt + rng.integers(10, vocab, 8).tolist())
    asyncio.run(run_all())
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


def table(rows: list[Row]) -> None:
    print(f"  {'policy':<28}{'hit rate':>9}{'prefill/req':>12}{'TTFT p50':>10}{'p99':>8}{'E2EL p50':>10}"
          f"{'p99':>8}{'tok/s':>8}   requests (busy) per replica")
    for r in rows:
        s = r.result
        print(f"  {r.name:<28}{100 * r.hit_rate:8.1f}%{r.computed_per_req:12.0f}{s.ttft.median:10.0f}{s.ttft.p99:8.0f}"
              f"{s.e2el.median:10.0f}{s.e2el.p99:8.0f}{s.output_throughput:8.1f}   "
              + "  ".join(f"{n}" + (f" ({b:.0%})" if r.busy else "") for n, b in zip(r.routed, r.busy or r.routed)))
    print("  (times in ms; prefill/req: prompt tokens each request computed, hits excluded;\n"
          "   busy: share of the run a replica spent in engine steps, the rest it waited for work)")


def saving(b: float, base: Row, other: Row) -> tuple[float, float, float]:
    """(prompt tokens saved per request, what that saves a lone request's TTFT, the measured
    saving of mean TTFT); times in ms."""
    fewer = base.computed_per_req - other.computed_per_req
    return fewer, b * fewer * 1e3, base.result.ttft.mean - other.result.ttft.mean


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--systems", type=int, default=2, help="distinct system prompts the conversations share")
    p.add_argument("--system-len", type=int, default=256, help="system prompt tokens")
    p.add_argument("--user-len", type=int, default=24, help="tokens of a user turn (the second workload: x4)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--rate", type=float, default=1.5, help="conversations started per second (Poisson)")
    p.add_argument("--kv-mib", type=int, default=256, help="KV pool of each replica")
    p.add_argument("--trace-dir", default=None, help="write the replicas' steps under the cache-aware policy "
                   "there: a Chrome trace (open in ui.perfetto.dev) and a PNG")
    add_launch_flags(p, "python -m advanced.adv08_data_parallel.node")
    args = p.parse_args()
    args.repeats = args.repeats or 1
    dtype = setup(args)
    folder = resolve_model(args.model)
    threads = args.threads or 2
    options = dict(dtype=dtype, kv_cache_bytes=args.kv_mib * 2**20)
    per_replica = max(1, threads // args.replicas)
    run_torchrun_replica(folder, args.replicas, dtype, threads=per_replica, kv_cache_bytes=options["kv_cache_bytes"])
    try:
        launch = launch_from_args(args)                      # torchrun's ranks, or the flags
    except ValueError as e:
        p.error(str(e))
    if launch.node_rank != 0:
        p.error(f"run.py is node 0 (the front end); node {launch.node_rank} runs "
                f"`python -m advanced.adv08_data_parallel.node --data-parallel-size {args.replicas} ...`")
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})")
    if warning := busy_warning():
        print(warning)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, {args.systems} shared system "
          f"prompts of {args.system_len} tokens, {args.user_len}-token user turns, {args.max_tokens} tokens per "
          f"reply, {args.rate:g} conversations/s (Poisson); the same arrival times for every row\n")
    t0 = time.perf_counter()
    with DPFrontEnd(folder, args.replicas, "round_robin", threads_per_replica=per_replica, trace=True, launch=launch,
                    **options) as front:
        print(f"{args.replicas} replicas, {front.facts[0]['threads']} torch thread(s) each, started in "
              f"{time.perf_counter() - t0:.1f} s")
        rows = []
        for seed, (policy, opts) in enumerate(POLICIES, start=1):
            front.set_policy(policy, **opts)
            name = policy + (f" ({opts['tie_break']} ties)" if opts else "")
            rows.append(measure(front, name, args, vocab, seed))
            print(f"  {name}: done, routing decisions {dict(front.router.decisions)}")
        front.set_policy("cache_aware")
        a, b = calibrate(front, vocab)
        second = []
        for seed, policy in [(11, "round_robin"), (12, "cache_aware")]:
            front.set_policy(policy)
            second.append(measure(front, policy, args, vocab, seed, user_len=4 * args.user_len))
    one = OneEngine(folder, dtype, options["kv_cache_bytes"], threads)
    try:
        single = measure(one, f"one engine, {threads} threads", args, vocab, 20)
    finally:
        one.close()

    if args.trace_dir:
        out = Path(args.trace_dir)
        paths = (write_chrome_trace(rows[2].timelines, out / "adv08_cache_aware.json"),
                 draw_png(rows[2].timelines, out / "adv08_cache_aware.png", "replica steps, cache_aware"))
        print("trace: " + ", ".join(map(str, paths)))
    print(f"\n(a) routing policies, {args.replicas} replicas, equal load")
    table(rows + [single])
    print(f"\n(b) prefill cost model, fitted on lone requests to one replica: TTFT = {a * 1e3:.0f} ms + "
          f"{b * 1e6:.0f} us x prompt tokens computed")
    fewer, direct, measured = saving(b, rows[0], rows[2])
    # Under load a request also waits for the prefills queued ahead of it, so each token saved is
    # worth more than its own compute: k, fitted here, carries that to the second workload.
    k = measured / direct if direct > 0 else float("nan")
    print(f"  fitted workload: cache_aware computes {fewer:.0f} fewer prompt tokens per request than round_robin;"
          f" that is {direct:.0f} ms of a lone request's TTFT; measured: {measured:.0f} ms lower mean TTFT"
          f" (queueing factor k = {k:.2f})")
    print(f"  second workload: user turns of {4 * args.user_len} tokens (more history per turn to reuse)")
    table(second)
    fewer2, direct2, measured2 = saving(b, second[0], second[1])
    if k > 0:
        print(f"  second workload: {fewer2:.0f} fewer prompt tokens per request; predicted k x {direct2:.0f} ="
              f" {k * direct2:.0f} ms lower mean TTFT; measured: {measured2:.0f} ms lower")
    else:                    # the first saving drowned in noise: nothing to carry over
        print(f"  second workload: {fewer2:.0f} fewer prompt tokens per request, {direct2:.0f} ms for a lone request;"
              f" measured: {measured2:.0f} ms lower (no k to predict with: the first saving was lost in noise)")
    best = max(rows, key=lambda r: r.result.output_throughput)
    ratio = best.result.output_throughput / max(1e-9, single.result.output_throughput)
    print(f"\n(c) throughput: the best policy ({best.name}) gave {ratio:.2f}x one engine's on all {threads} threads")


if __name__ == "__main__":
    main()
