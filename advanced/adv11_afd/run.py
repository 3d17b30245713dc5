"""Advanced lesson 11: attention/FFN disaggregation. Every layer's MLP in another process; the
attention side ships its hidden states there and back per layer, with 1 and 2 micro-batches
ping-ponging, at 1 and 2 FFN processes and at 2 attention processes : 1 FFN process, against one
process: step time, busy share of each side
from the timeline, bytes per layer priced on 10/25/100 Gbit/s, and a cost model fitted on one run
that predicts the balancing attention:FFN ratio and is checked on the others."""
from __future__ import annotations

import os
from pathlib import Path

from minivllm_support.cli import base_parser
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timeline import Timeline, chrome_trace, draw_png, validate_trace, write_chrome_trace
from minivllm_support.timing import compare
from step04_transformer.start import start_lesson
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from advanced.adv06_pipeline_parallel.run import QUESTIONS, one_process
from advanced.adv11_afd.engine import AFDEngine
from advanced.adv11_afd.report import report


def disaggregated(engine: AFDEngine, m: int, prompts, sp):
    def run() -> dict:
        engine.set_micro_batches(m)
        engine.collect_timelines()                       # drop what earlier runs recorded
        engine.traffic.reset()
        steps = engine.runner.steps
        seqs = engine.generate(prompts, sp)
        t = engine.traffic
        return dict(outputs=[s.output_token_ids for s in seqs], timelines=engine.collect_timelines(),
                    traffic=dict(to_ffn=t.to_ffn, from_ffn=t.from_ffn, plan=t.plan, exchanges=t.exchanges,
                                 layer_tokens=t.layer_tokens, from_peers=t.from_peers,
                                 steps=engine.runner.steps - steps))
    return run


def trace_name(variant: str) -> str:
    """"AFD 1:2, m=2" -> "trace_1to2_m2.json"."""
    ratio, m = variant.split()[1].rstrip(","), variant.split("=")[1]
    return f"trace_{ratio.replace(':', 'to')}_m{m}.json"


def one_decode_step(timelines: list[Timeline], layers: int = 4) -> tuple[list[Timeline], int]:
    """The same ranks with only the first `layers` layers of one decode step (a step of the fewest
    tokens in which every attention rank works, from the middle of those): readable, where the
    whole run is thousands of spans."""
    tokens: dict[int, int] = {}
    seen: dict[int, set[int]] = {}                       # 2:1: the attention ranks that worked in a step
    attention = [tl for tl in timelines if any("kv_tokens" in s.args for s in tl.spans)]
    for tl in attention:
        for s in tl.spans:
            if "kv_tokens" in s.args and s.args["layer"] == 0:
                tokens[s.args["step"]] = tokens.get(s.args["step"], 0) + s.args["tokens"]
                seen.setdefault(s.args["step"], set()).add(tl.rank)
    both = {k: n for k, n in tokens.items() if len(seen[k]) == len(attention)}
    tokens = both or tokens                              # prefer a step where every attention rank works
    fewest = sorted(k for k, n in tokens.items() if n == min(tokens.values()))
    k = fewest[len(fewest) // 2]
    return [Timeline(tl.rank, tl.name, [s for s in tl.spans if s.args.get("step") == k
                                        and s.args.get("layer", layers) < layers], tl.offset_ns)
            for tl in timelines], k


def workload(tok, n: int, max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n chat requests whose contexts grow with i (0 to 7 copies of a short document before the
    question) and whose lengths differ (max_tokens, 3/4, 1/2, 1/4 of it in turn, ignore_eos: the same
    work in every variant). The decode batch shrinks as requests finish and its micro-batches read
    different amounts of KV, so the cost model can tell tokens from KV tokens."""
    doc = " ".join(QUESTIONS)
    prompts = [chat_prompt_ids(tok, f"{(doc + ' ') * ((8 * i) // n)}{QUESTIONS[i % len(QUESTIONS)]}") for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=max(1, max_tokens - (i % 4) * max_tokens // 4), ignore_eos=True)
              for i in range(n)]
    return prompts, params


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ffn", default="1,2", help="FFN processes to run (attention is always 1 process); "
                   "the first count's m=1 run fits the cost model")
    p.add_argument("--attn", default=None, help="attention processes: 1 (with each --ffn count) and 2 (2:1, one "
                   "FFN process, this machine only); default 1,2 (1 across machines)")
    p.add_argument("--out", type=Path, default=Path("build/adv11"), help="folder for the traces")
    add_launch_flags(p, "python -m advanced.adv11_afd.node --num-ffn N   (one --ffn count per run across machines)")
    args = p.parse_args()
    args.repeats = args.repeats or 2
    dtype, folder, model, tok = start_lesson(args)
    cores = args.threads or os.cpu_count() or 1
    ffn_counts = [int(n) for n in args.ffn.split(",")]
    launch = launch_from_args(args)
    attn_counts = [int(n) for n in (args.attn or ("1" if launch and launch.nnodes > 1 else "1,2")).split(",")]
    if not set(attn_counts) <= {1, 2} or 1 not in attn_counts:
        p.error(f"--attn takes 1 or 1,2 (the 1:N runs fit the cost model), got {args.attn}")
    if 2 in attn_counts and launch and launch.nnodes > 1:
        p.error("--attn 2 (2:1) runs on one machine only: leave it out with --nnodes")
    ratios = [(1, n) for n in ffn_counts] + [(2, 1)] * (2 in attn_counts)
    prompts, sp = workload(tok, args.requests, args.max_tokens)
    args.generated = sum(p.max_tokens for p in sp)
    config = PagedSchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=256, block_size=16,
                                  kv_cache_bytes=64 * 2**20)
    print(f"workload: {len(prompts)} chat requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {min(p.max_tokens for p in sp)}-{args.max_tokens} greedy tokens each; prompts chunked by {config.max_num_batched_tokens} tokens")
    single = build_engine(model, config, use_graph=False)
    runs = compare({f"one process, {cores} threads": one_process(single, cores, prompts, sp),
                    "one process, 1 thread": one_process(single, 1, prompts, sp)}, repeats=args.repeats)
    memory = {}
    for n_attn, n_ffn in ratios:
        with AFDEngine(folder, config, num_ffn=n_ffn, num_attention=n_attn, dtype=dtype, threads_per_rank=1,
                       launch=launch) as engine:
            memory[f"{n_attn}:{n_ffn}"] = engine.rank_memory
            # the first count's m=1 run fits the model; 2:1 is checked against it at m = 1 and 2
            ms = (1, 2) if n_ffn == ffn_counts[0] else (2,)
            runs.update(compare({f"AFD {n_attn}:{n_ffn}, m={m}": disaggregated(engine, m, prompts, sp) for m in ms},
                                repeats=args.repeats))
    print("\nprocesses: attention + FFN processes, 1 torch thread each; weights per rank (MiB, rank order: "
          "attention, FFN, second attention): " + "; ".join(
        f"{k} {[round(r['weight_bytes'] / 2**20, 1) for r in mem]}" for k, mem in memory.items())
        + f" (one process: {round(sum(t.numel() * t.element_size() for t in model.parameters()) / 2**20, 1)})")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, t in runs.items():
        if "timelines" in t.result:
            tls = t.result["timelines"]
            problems = validate_trace(chrome_trace(tls))
            t.result["trace"] = (write_chrome_trace(tls, args.out / trace_name(name))
                                 .as_posix() + ("" if not problems else f" (invalid: {problems[:2]})"))
            few, k = one_decode_step(tls)
            png = draw_png(few, args.out / trace_name(name).replace("trace_", "timeline_").replace(".json", ".png"),
                           title=f"{name}: layers 0-3 of decode step {k}")
            t.result["trace"] += f", {png.as_posix()}"
    report(runs, args, dtype, model.config, ffn_counts)


if __name__ == "__main__":
    main()
