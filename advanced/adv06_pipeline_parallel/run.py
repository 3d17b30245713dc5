"""Advanced lesson 06: pipeline parallelism. The model's layers split over --pp processes, with
1, 2 and 4 micro-batches in flight, against one process; the timeline of every rank, the
bubble it shows against GPipe's formula, the bytes between stages, and a fitted cost model
checked against runs it was not fitted on."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from minivllm_support.cli import base_parser, identity_line
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timeline import Timeline, bubble_formula, chrome_trace, draw_png, validate_trace, window, \
    write_chrome_trace
from minivllm_support.timing import compare
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from step17_tensor_parallel.model import local_config
from advanced.adv06_pipeline_parallel.costmodel import (bubble_fractions, compute_slowdown, fit_hop, fit_lm_head,
                                                        fit_stage_costs, hop_samples, layer_spans, micro_batches,
                                                        predict_seconds, rank0_overhead)
from advanced.adv06_pipeline_parallel.engine import PPEngine

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Why do cats purr?", "Explain what a compiler does in two sentences.", "Suggest a name for a grey cat.",
             "How do I boil an egg?", "What is 12 times 7?", "Name a famous painting and its painter.",
             "Give me a tip for learning to swim.", "What does a bee do all day?", "Describe the colour blue."]


def tpot_ms(seqs) -> float:
    """Mean time between two output tokens of a sequence, over all sequences."""
    gaps = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) for s in seqs if len(s.token_times) > 1]
    return 1e3 * sum(gaps) / max(1, len(gaps))


def one_process(engine, threads: int, prompts, sp):
    def run() -> dict:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            seqs = engine.generate(prompts, sp)
        finally:
            torch.set_num_threads(before)
        return dict(outputs=[s.output_token_ids for s in seqs], tpot=tpot_ms(seqs))
    return run


def pipelined(engine: PPEngine, m: int, prompts, sp):
    def run() -> dict:
        engine.set_micro_batches(m)
        engine.collect_timelines()                       # drop what earlier runs recorded
        sent = dict(engine.bytes_sent)
        seqs = engine.generate(prompts, sp)
        tls = engine.collect_timelines()
        launched = len(layer_spans(tls[0]))
        per_step = {k: (engine.bytes_sent[k] - sent[k]) / launched for k in sent}
        return dict(outputs=[s.output_token_ids for s in seqs], tpot=tpot_ms(seqs), timelines=tls,
                    launched=launched, bytes=per_step)
    return run


def zoom(timelines: list[Timeline], count: int) -> tuple[list[Timeline], range]:
    """The same ranks with only the spans of `count` steps from the middle of the run: readable."""
    steps = sorted({s.args["step"] for s in layer_spans(timelines[0])})
    keep = range(steps[len(steps) // 2], steps[len(steps) // 2] + count)
    return [Timeline(tl.rank, tl.name, [s for s in tl.spans if s.args.get("step") in keep], tl.offset_ns)
            for tl in timelines], keep


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="ranks per stage, each layer split over them (TP x PP: "
                   "pp x tp processes)")
    p.add_argument("--micro-batches", default="1,2,4", help="micro-batches in flight to compare; the first "
                   "one's timeline fits the cost model, the others check it")
    p.add_argument("--partition", default=None, help="layers per stage, e.g. 13,17 (default: the even rule "
                   "of partition.py); rank 0 (stage 0) also runs the scheduler, the LM head and the sampler")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("build/adv06"), help="folder for the traces and PNGs")
    add_launch_flags(p, "python -m advanced.adv06_pipeline_parallel.node")
    args = p.parse_args()
    args.repeats = args.repeats or 2
    ms = [int(m) for m in args.micro_batches.split(",")]
    dtype, folder, model, tok = start_lesson(args)
    cores = args.threads or os.cpu_count() or 1
    prompts = [chat_prompt_ids(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)   # equal work everywhere
    config = PagedSchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=128, block_size=16,
                                  kv_cache_bytes=128 * 2**20)
    print(f"workload: {len(prompts)} chat requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.max_tokens} greedy tokens each; prompts chunked by {config.max_num_batched_tokens} tokens")
    single = build_engine(model, config, use_graph=False)
    threads = max(1, cores // (args.pp * args.tp))
    try:
        local_config(model.config, args.tp)
    except ValueError as e:          # SmolLM2 has 9 heads: --tp 3 splits it, --tp 2 does not
        p.error(str(e))
    with PPEngine(folder, config, pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp, dtype=dtype,
                  threads_per_rank=threads, layer_partition=args.partition, launch=launch_from_args(args)) as pp:
        print(f"pipeline: {args.pp} stages x {args.tp} TP rank(s) = {pp.world} processes, {threads} torch thread(s) "
              f"each; layers per stage "
              f"{[s.num_layers for s in pp.stages]}; weights per rank "
              f"{[round(m['weight_bytes'] / 2**20) for m in pp.rank_memory]} MiB "
              f"(one process: {round(sum(t.numel() * t.element_size() for t in model.parameters()) / 2**20)} MiB)\n")
        variants = {f"one process, {cores} threads": one_process(single, cores, prompts, sp),
                    f"one process, {threads} thread": one_process(single, threads, prompts, sp)}
        name = f"PP={args.pp}" + (f" x TP={args.tp}" if args.tp > 1 else "")
        variants.update({f"{name}, {m} micro-batch{'es' if m > 1 else ''}": pipelined(pp, m, prompts, sp)
                         for m in ms})
        runs = compare(variants, repeats=args.repeats)
    report(runs, args, ms, dtype, model.config.hidden_size * model.model.embed_tokens.weight.element_size())


def report(runs, args, ms, dtype, token_bytes: int) -> None:
    base = next(iter(runs.values()))
    gen = args.requests * args.max_tokens
    print(f"\n{'variant':<30}{'wall time':>34}{'tokens/s':>10}{'TPOT ms':>9}   identical to one process")
    for name, t in runs.items():
        same = sum(a == b for a, b in zip(t.result["outputs"], base.result["outputs"]))
        print(f"{name:<30}{t.describe():>34}{gen / t.median:>10.0f}{t.result['tpot']:>9.1f}   {same}/{args.requests}")
    pp_runs = [runs[n] for n in runs if n.startswith("PP=")]
    same = sum(a == b for t in pp_runs for a, b in zip(t.result["outputs"], base.result["outputs"]))
    print(identity_line("outputs, every pipeline run vs one process", same, args.requests * len(pp_runs), dtype))

    name = f"PP={args.pp}" + (f" x TP={args.tp}" if args.tp > 1 else "")
    print(f"\nbubble per {'rank' if args.tp > 1 else 'stage'} (1 - compute / window, the last timed run) "
          f"vs GPipe's (p-1)/(m+p-1):")
    args.out.mkdir(parents=True, exist_ok=True)
    for m, t in zip(ms, pp_runs):
        tls = t.result["timelines"]
        bubbles = bubble_fractions(tls)
        problems = validate_trace(chrome_trace(tls))
        trace = write_chrome_trace(tls, args.out / f"trace_m{m}.json")
        png = draw_png(tls, args.out / f"timeline_m{m}.png",
                       title=f"{name}, {m} micro-batch(es) in flight: one row per rank")
        few, steps = zoom(tls, 3 * max(m, args.pp))
        draw_png(few, args.out / f"timeline_m{m}_zoom.png",
                 title=f"{name}, {m} micro-batch(es) in flight: steps {steps.start}-{steps.stop - 1}")
        b = t.result["bytes"]
        print(f"  m={m}: stages {' '.join(f'{x:.0%}' for x in bubbles)} idle   formula {bubble_formula(args.pp, m):.0%}"
              f"   {t.result['launched']} micro-batches; per micro-batch {b['hidden'] / 1024:.1f} KiB hidden, "
              f"{b['returned'] / 1024:.1f} KiB normed rows back to rank 0, {b['metadata'] / 1024:.1f} KiB metadata"
              f"\n        trace {'valid' if not problems else problems[:2]}: {trace}, {png} (and _zoom.png)")

    if args.tp > 1:        # the model below has one rank per stage; with TP a stage is several rows
        print("\ncost model: fitted for --tp 1 only (with TP a stage's ranks also wait on each other's all-reduces)")
        return
    fit_tls = pp_runs[0].result["timelines"]
    costs, hop, head = fit_stage_costs(fit_tls), fit_hop(hop_samples(fit_tls)), fit_lm_head(fit_tls[0])
    overhead = rank0_overhead(fit_tls[0])
    print(f"\ncost model, fitted on the m={ms[0]} run's timeline (a model: least squares over its spans):")
    for c in costs:
        print(f"  stage {c.rank}: {1e3 * c.fixed_s:.2f} ms + {1e6 * c.per_token_s:.1f} us per token")
    size = (f"bytes / {hop.bandwidth / 1e9:.2f} GB/s" if hop.per_byte_s > 0 else
            "no cost per byte that the fit could separate from the fixed cost")
    print(f"  LM head on rank 0: {1e3 * head.fixed_s:.2f} ms + {1e6 * head.per_token_s:.1f} us per sampled row")
    print(f"  hop: {1e6 * hop.fixed_s:.0f} us + {size} "
          f"({len(hop_samples(fit_tls))} transfers with the receiver waiting)")
    print(f"  rank 0 outside the model: {1e3 * overhead[0]:.2f} ms scheduling + {1e3 * overhead[1]:.2f} ms sampling"
          f" per micro-batch")
    for m, t in zip(ms, pp_runs):
        tls = t.result["timelines"]
        lo, hi = window(tls)
        predicted = predict_seconds(micro_batches(tls), costs, hop, overhead, m, head)
        slow = compute_slowdown(tls, costs)
        print(f"  m={m}: predicted {predicted:.2f} s, measured {(hi - lo) / 1e9:.2f} s (timeline window)"
              f"{'   <- fitted here' if m == ms[0] else ''}; stage compute ran "
              f"{' / '.join(f'{x:.2f}x' for x in slow)} the fitted time")
    where_it_pays(costs, head, hop, overhead, args, token_bytes)


def where_it_pays(costs, head, hop, overhead, args, token_bytes: int) -> None:
    """What the fitted numbers say about a pipeline whose stages do not share cores."""
    B = args.requests
    stage = [c(B) for c in costs]
    stage[0] += head(B) if len(costs) > 1 else 0.0             # rank 0 runs the LM head too
    hidden = B * token_bytes
    print(f"\nwhere it pays, by the model (not measured): a decode micro-batch of {B} tokens costs "
          f"{' + '.join(f'{1e3 * s:.2f}' for s in stage)} ms over the stages (stage 0's with the LM head); "
          f"in one process on one core "
          f"that is {1e3 * sum(stage):.2f} ms a step")
    slowest = max(stage[0] + sum(overhead), *stage[1:])
    print(f"  with every stage on its own core and >= {len(costs)} micro-batches in flight, one leaves the "
          f"pipeline every {1e3 * slowest:.2f} ms (its slowest stage; rank 0's counted with its LM head, scheduling "
          f"and sampling): "
          f"{sum(stage) / slowest:.2f}x one core's rate")
    print(f"  a hop of that micro-batch ({hidden / 1024:.0f} KiB) costs ~{1e6 * hop(hidden):.0f} us, "
          f"{hop(hidden) / max(stage):.0%} of a stage's compute: PP pays where each stage computes much longer "
          f"than a hop (bigger layers, more tokens per micro-batch) and where the model does not fit one "
          f"machine's memory at all (each rank holds only its layers)")


if __name__ == "__main__":
    main()
