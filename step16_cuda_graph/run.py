"""Lesson 16: graph capture. Decode steps padded to a batch bucket and run by a recorded program:
a CUDA graph on a GPU, the layer body compiled by torch.compile on a CPU.

1. the runner this machine gets, its buckets, and how long recording them took (cold: inductor
   compiled C++; warm: its on-disk cache had the code from an earlier start);
2. eight chat requests through lesson 15's engine and lesson 16's: same answers, which buckets
   the decode steps used, wall time;
3. one decode step's latency at batch 1 and 8 (context ~360 tokens), eager vs compiled, taking turns.
"""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.lesson import start_lesson
from minivllm_support.models import chat_prompt_ids
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.engine import FlashEngine
from step16_cuda_graph.bench import alternate
from step16_cuda_graph.engine import GraphEngine

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain why the sky is blue in two sentences.", "What is 12 times 12?",
             "Name a famous painting and its painter.", "Give me a tip for learning Python.",
             "What does a compiler do?"]


def config() -> PagedSchedulerConfig:
    return PagedSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20)


def build_graph_engine(model) -> GraphEngine:
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    warm = cache.is_dir() and any(cache.iterdir())
    t0 = time.perf_counter()
    engine = GraphEngine(model, config())
    runner = engine.runner
    if runner is None:
        print("runner: none (torch.compile does not work here): decode steps run eagerly\n")
        return engine
    print(f"runner: {runner.mode}, buckets {runner.buckets} (max_num_seqs=8)")
    print(f"engine built in {time.perf_counter() - t0:.1f} s, of which recording the buckets and "
          f"compiling the prompt step {engine.record_seconds:.1f} s "
          f"({'warm' if warm else 'cold'} start: inductor cache {cache})\n")
    return engine


def chat(lesson15_model, tok, engine: GraphEngine, dtype) -> None:
    prompts = [chat_prompt_ids(tok, q) for q in QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for name, eng in [("lesson 15", FlashEngine(lesson15_model, config())), ("lesson 16", engine)]:
        t0 = time.perf_counter()
        outs[name] = [s.output_token_ids for s in eng.generate(prompts, sp)]
        print(f"  {name}: {sum(map(len, outs[name]))} tokens in {time.perf_counter() - t0:5.2f} s, "
              f"{eng.num_steps} steps")
    if engine.runner is not None:
        used = ", ".join(f"bucket {b}: {n}" for b, n in sorted(engine.runner.replays.items()))
        print(f"  lesson 16 decode steps run by the runner: {used}")
    a, b = outs.values()
    print(f"  Q: {QUESTIONS[0]}\n  A: {tok.decode(b[0], skip_special_tokens=True).strip()!r}")
    print("  " + identity_line("answers of lesson 15 and lesson 16", sum(x == y for x, y in zip(a, b)), len(a), dtype))


def step_latency(model, engine: GraphEngine) -> None:
    print("\none decode step, context ~360 tokens (eager and compiled take turns, best of 3):")
    eager = GraphEngine(model, config(), use_graph=False)
    for b in (1, 8):
        best = alternate({"eager": eager, "compiled": engine}, b, 360, 8, rounds=3)
        print(f"  batch {b}: eager {best['eager']:6.1f} ms, compiled {best['compiled']:6.1f} ms  "
              f"({best['eager'] / best['compiled']:.2f}x)")


def main() -> None:
    args = base_parser(__doc__).parse_args()
    dtype, folder, model, tok = start_lesson(args)
    plain = copy.deepcopy(model)      # lesson 15's own copy: lesson 16 fuses q|k|v and gate|up in place
    engine = build_graph_engine(model)
    print("eight chat requests, greedy, up to 48 tokens:")
    chat(plain, tok, engine, dtype)
    if engine.runner is not None:
        step_latency(model, engine)


if __name__ == "__main__":
    main()
