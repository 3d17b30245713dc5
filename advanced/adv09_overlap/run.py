"""Advanced lesson 09: two-batch overlap. Lesson 17's tensor-parallel engine whose steps are cut
into two micro-batches, so that one micro-batch's all-reduces run (gloo, asynchronously) while
the other computes. Same tokens as one process; step time with and without the overlap at a
small and a large decode batch and for a long prefill, steps taking turns; how much of the
all-reduce time the overlap hid (from the timeline), and why it wins or loses here."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timeline import Timeline, chrome_trace, draw_png, validate_trace, write_chrome_trace
from minivllm_support.timing import busy_warning
from step04_transformer.start import start_lesson
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from step17_tensor_parallel.run import QUESTIONS, smallest_split
from advanced.adv09_overlap.engine import OverlapEngine
from advanced.adv09_overlap.measure import half_layer_model, rank_stats

MODES = {False: "plain", True: "overlap"}


def identity(engine: OverlapEngine, model, config, prompts, dtype) -> None:
    sp = SamplingParams(temperature=0, max_tokens=24)
    ref = [s.output_token_ids for s in build_engine(model, config, use_graph=False).generate(prompts, sp)]
    outs = {}
    for overlap in (True, False):
        engine.overlap = overlap
        outs[overlap] = [s.output_token_ids for s in engine.generate(prompts, sp)]
    tp, notes = f"TP={engine.tp}", set()
    for what, a, b in ((f"answers, {tp} overlap vs {tp} plain schedule", outs[True], outs[False]),
                       (f"answers, {tp} overlap schedule vs one process", outs[True], ref),
                       (f"answers, {tp} plain schedule vs one process", outs[False], ref)):
        lines = identity_line(what, sum(x == y for x, y in zip(a, b)), len(ref), dtype).split("\n", 1)
        print(lines[0])
        notes.update(lines[1:])
    for note in notes:
        print(note)                                      # why bf16 may differ: said once
    engine.collect_timelines()                           # drop these steps' spans


def timed_step(engine: OverlapEngine, overlap: bool, times: dict, steps: dict) -> None:
    engine.overlap = overlap
    steps[overlap].add(engine.runner.steps)               # the number every rank stamps on its spans
    t0 = time.perf_counter()
    engine.step()
    times[overlap].append(time.perf_counter() - t0)


def decode_scenario(engine: OverlapEngine, prompts, batch: int, rounds: int):
    """`batch` sequences decoding; after their prefill the two schedules take turns step by step."""
    warm = 4
    sp = SamplingParams(temperature=0, max_tokens=warm + 2 * rounds + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(prompts[i % len(prompts)], sp)
    for i in range(warm):                                  # the prefill, then both schedules once
        engine.overlap = bool(i % 2)
        engine.step()
    engine.collect_timelines()
    times, steps = {False: [], True: []}, {False: set(), True: set()}
    for i in range(2 * rounds):
        timed_step(engine, bool(i % 2), times, steps)
    timelines = engine.collect_timelines()
    while engine.has_unfinished():
        engine.step()
    return times, steps, timelines


def prefill_scenario(engine: OverlapEngine, vocab: int, seqs: int, length: int, rounds: int):
    """`seqs` fresh prompts of `length` tokens prefilled in one step (no prefix-cache hit), turn by turn."""
    g = torch.Generator().manual_seed(0)
    times, steps = {False: [], True: []}, {False: set(), True: set()}
    sp = SamplingParams(temperature=0, max_tokens=1)
    for i in range(2 * (rounds + 1)):
        for _ in range(seqs):
            engine.add_request(torch.randint(100, vocab, (length,), generator=g).tolist(), sp)
        if i < 2:                                          # one untimed step of each schedule first
            engine.overlap = bool(i % 2)
            engine.step()
        else:
            timed_step(engine, bool(i % 2), times, steps)
        if engine.has_unfinished():
            raise RuntimeError("the prefill did not fit one step: raise max_num_batched_tokens")
    return times, steps, engine.collect_timelines()


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):7.1f} ms ({1e3 * min(xs):.1f}-{1e3 * max(xs):.1f})"


def report(name: str, times, steps, timelines: list[Timeline], tokens: int) -> dict:
    plain, over = statistics.median(times[False]), statistics.median(times[True])
    gain = plain / over - 1
    print(f"{name:<28}{tokens:>7}  {ms(times[False]):>27}  {ms(times[True]):>27}  {100 * gain:+6.0f}% "
          f"({'faster' if gain > 0 else 'slower'} with overlap)")
    stats = {mode: rank_stats(timelines, mode, steps[mode])[0] for mode in (False, True)}
    return dict(stats=stats, plain=plain, overlap=over, steps=len(times[False]))


def explain(name: str, r: dict, layers: int) -> None:
    p, o = r["stats"][False], r["stats"][True]
    c_full, r_full = p.mean_half_layer_us(), p.mean_all_reduce_us()
    c_mb, r_mb = o.mean_half_layer_us(), o.mean_all_reduce_us()
    plain_us, over_us = half_layer_model(c_full, r_full, c_mb, r_mb)
    halves = 2 * layers
    print(f"{name:<28}{c_full:8.0f} us {r_full:8.0f} us | {c_mb:8.0f} us {r_mb:8.0f} us {100 * o.hidden_fraction:6.0f}%"
          f"  {p.wait_ns / 1e6 / r['steps']:6.1f} -> {o.wait_ns / 1e6 / r['steps']:5.1f} ms"
          f"  {halves * plain_us / 1e3:6.1f} -> {halves * over_us / 1e3:6.1f} ms"
          f"  {'yes' if (over_us < plain_us) == (r['overlap'] < r['plain']) else 'no'}")


def zoom(timelines: list[Timeline], step: int, layers: range) -> list[Timeline]:
    """The same rows with only one step's spans of a few layers: readable on a page."""
    def keep(s) -> bool:
        return s.args.get("step") == step and s.args.get("layer", -1) in layers
    return [Timeline(tl.rank, tl.name, [s for s in tl.spans if keep(s)], tl.offset_ns) for tl in timelines]


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--tp", type=int, default=None, help="tensor_parallel_size (default: the smallest split the "
                   "model allows: 3 for SmolLM2, whose 9 heads do not split 2 ways; 2 for Qwen3)")
    p.add_argument("--small", type=int, default=4, help="sequences of the small decode batch")
    p.add_argument("--large", type=int, default=32, help="sequences of the large decode batch")
    p.add_argument("--prefill", default="4x128", help="the prefill step: sequences x tokens each")
    p.add_argument("--out", type=Path, default=Path("build/adv09"), help="folder for the trace and the PNG")
    add_launch_flags(p, "python -m advanced.adv09_overlap.node")
    args = p.parse_args()
    repeats = args.repeats or 3
    dtype, folder, model, tok = start_lesson(args)
    cfg = model.config
    tp = args.tp or smallest_split(cfg)
    seqs, length = (int(x) for x in args.prefill.split("x"))
    config = PagedSchedulerConfig(max_num_seqs=max(args.large, seqs, 8), max_num_batched_tokens=max(512, seqs * length),
                                  kv_cache_bytes=256 * 2**20 // tp)
    launch = launch_from_args(args)
    threads = max(1, (args.threads or os.cpu_count() or 1) // len(launch.local_ranks(tp)))   # this machine's ranks
    prompts = [chat_prompt_ids(tok, q) for q in QUESTIONS]
    with OverlapEngine(folder, config, tensor_parallel_size=tp, dtype=dtype, threads_per_rank=threads,
                       launch=launch) as engine:
        print(f"TP={tp}: {tp} processes, {threads} torch thread(s) each, all-reduces through gloo "
              f"({cfg.num_layers} layers: {2 * cfg.num_layers} all-reduces of [tokens, {cfg.hidden_size}] per step "
              f"and micro-batch)\n")
        identity(engine, model, config, prompts[:8], dtype)
        if warning := busy_warning():
            print(warning)
        rounds = 4 * repeats
        print(f"\nstep time, median (min-max) of {rounds} steps each, the two schedules taking turns step by step:")
        print(f"{'':<28}{'tokens':>7}  {'plain (lesson 17)':>27}  {'two-batch overlap':>27}")
        results = {}
        for batch in (args.small, args.large):
            times, steps, tls = decode_scenario(engine, prompts, batch, rounds)
            results[f"decode, {batch} sequences"] = report(f"decode, {batch} sequences", times, steps, tls, batch)
            trace_tls, trace_steps = tls, steps
        name = f"prefill, {seqs} x {length} tokens"
        times, steps, tls = prefill_scenario(engine, cfg.vocab_size, seqs, length, max(2, repeats))
        results[name] = report(name, times, steps, tls, seqs * length)

    print(f"\nwhy, per half layer (attention or MLP) on rank 0, means from the timeline (c: compute of a lane, "
          f"r: an all-reduce, start to sum; ' = per micro-batch);\nthe model (measure.py): plain = c + r, "
          f"overlap = max(2 c', c' + r'), times {2 * cfg.num_layers} half layers:")
    print(f"{'':<28}{'plain: c':>11} {'r':>11} | {'overlap: c':>11} {'r':>11} {'hidden':>7}  "
          f"{'waited/step':>15}  {'model, layers/step':>19}  same sign as measured")
    for name, r in results.items():
        explain(name, r, cfg.num_layers)
    write_figures(trace_tls, trace_steps, args.out, args.large)


def write_figures(timelines: list[Timeline], steps: dict, out: Path, batch: int) -> None:
    trace = write_chrome_trace(timelines, out / "trace_decode.json")
    problems = validate_trace(chrome_trace(timelines))
    step_over, step_plain = sorted(steps[True])[-1], sorted(steps[False])[-1]
    for mode, step in (("overlap", step_over), ("plain", step_plain)):
        draw_png(zoom(timelines, step, range(3)), out / f"timeline_{mode}.png",
                 title=f"decode, {batch} sequences, {mode} schedule: step {step}, layers 0-2")
    print(f"\ntrace {'valid' if not problems else problems[:2]}: {trace} (the large decode batch, both schedules); "
          f"{out}/timeline_overlap.png and timeline_plain.png (one step, layers 0-2)")


if __name__ == "__main__":
    main()
