"""Lesson 16: graph capture. Decode steps padded to a batch bucket and run by a recorded program
on static buffers: a CUDA graph on a GPU, the layer body compiled by torch.compile on a CPU.

1. the runner this machine gets: its mode, its buckets, the static buffers and the scratch
   block, and how long recording the buckets took (cold: inductor compiled C++; warm: its
   on-disk cache had the code from an earlier start);
2. eight chat requests through the eager engine (lesson 15's, with the same unpacked weights)
   and lesson 16's: same answers, which buckets the decode steps used, wall time; in bf16 the
   compiled body rounds its fused element-wise chains differently, so the same requests run
   again in float32, where the tests hold the two engines to identical tokens;
3. one decode step at batch 1 and 8 (context ~360 tokens), the engines taking turns: eager
   with the weights the recorded step uses (on a CPU lesson 04's unpacked linears: inductor
   cannot take oneDNN's packed weights, see engine.py), lesson 16's recorded step, and on a CPU
   lesson 15 as it is (eager, lesson 14's packed weights: what lesson 16's fast path gets back).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from step16_cuda_graph.decode_timing import step_turns
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.engine import build_engine

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain why the sky is blue in two sentences.", "What is 12 times 12?",
             "Name a famous painting and its painter.", "Give me a tip for learning Python.",
             "What does a compiler do?"]


def config() -> PagedSchedulerConfig:
    return PagedSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20)


def build_graph_engine(model):
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    warm = cache is not None and Path(cache).is_dir() and any(Path(cache).iterdir())
    t0 = time.perf_counter()
    engine = build_engine(model, config())
    secs, runner = time.perf_counter() - t0, engine.runner
    s = runner.static
    print(f"runner: {runner.mode}, buckets {runner.buckets} (max_num_seqs=8)")
    print(f"static buffers: input_ids {tuple(s.input_ids.shape)}, positions {tuple(s.positions.shape)}, "
          f"block_tables {tuple(s.block_tables.shape)}, ... allocated once; bucket b reads their first b rows")
    print(f"scratch block: {runner.scratch_block} of the pool's {engine.kv_pool.num_blocks} blocks (the block "
          f"manager hands out {engine.scheduler.block_manager.num_blocks}): padded rows write their K/V there")
    if runner.mode == "eager":
        print("torch.compile does not work here: each bucket runs eagerly on the static buffers\n")
    else:
        print(f"engine built in {secs:.1f} s, of which recording the buckets {runner.record_seconds:.1f} s "
              f"({'warm' if warm else 'cold'} start: inductor cache {cache})\n")
    return engine


def chat(eager, engine, tok, dtype) -> None:
    prompts, sp = [chat_prompt_ids(tok, q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for name, eng in [("eager (lesson 15)", eager), ("lesson 16", engine)]:
        t0 = time.perf_counter()
        outs[name] = [s.output_token_ids for s in eng.generate(prompts, sp)]
        print(f"  {name:17s}: {sum(map(len, outs[name]))} tokens in {time.perf_counter() - t0:5.2f} s, "
              f"{eng.num_steps} steps")
    used = ", ".join(f"bucket {b}: {n}" for b, n in engine.runner.replays.items())
    print(f"  lesson 16's decode steps per bucket: {used} (steps with prompt tokens run eagerly)")
    a, b = outs.values()
    print(f"  Q: {QUESTIONS[0]}\n  A: {tok.decode(b[0], skip_special_tokens=True).strip()!r}")
    print("  " + identity_line("answers of the eager engine and lesson 16", sum(x == y for x, y in zip(a, b)),
                               len(a), dtype))


def float32_answers(folder, tok) -> None:
    """The same requests through both engines built from the float32 model (the tests' comparison)."""
    t0 = time.perf_counter()
    model = load_model(folder, torch.float32)
    graph = build_engine(model, config())
    eager = build_engine(model, config(), use_graph=False, pack_weights=graph.runner.mode != "compile")
    prompts, sp = [chat_prompt_ids(tok, q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=48)
    a, b = ([s.output_token_ids for s in e.generate(prompts, sp)] for e in (eager, graph))
    print("  float32: " + identity_line("answers of the eager engine and lesson 16", sum(x == y for x, y in zip(a, b)),
                                        len(a), torch.float32) + f" ({time.perf_counter() - t0:.1f} s)")


def step_latency(engines: dict, batches=(1, 8), context: int = 360, steps: int = 8, rounds: int = 3) -> None:
    print(f"\none decode step, context ~{context} tokens (the engines take turns, {steps} steps a turn, "
          f"best of {rounds}):")
    for b in batches:
        best = step_turns(engines, b, context, steps, rounds, drain=True)
        ratio = best["eager"] / best["lesson 16"]
        print(f"  batch {b}: " + ", ".join(f"{name} {ms:5.1f} ms" for name, ms in best.items())
              + f"  (lesson 16 against eager on the same weights: {max(ratio, 1 / ratio):.2f}x "
              + ("faster)" if ratio >= 1 else "slower)"))


def main() -> None:
    args = add_watch_argument(base_parser(__doc__)).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    engine = build_graph_engine(model)
    # The eager engine with the weights the recorded step runs (unpacked on a CPU, see engine.py).
    eager = build_engine(model, config(), use_graph=False, pack_weights=engine.runner.mode != "compile")
    print("eight chat requests, greedy, up to 48 tokens:")
    chat(eager, engine, tok, dtype)
    if dtype != torch.float32:
        float32_answers(folder, tok)
    engines = {"eager": eager, "lesson 16": engine}
    if engine.runner.mode == "compile":            # and lesson 15 as it is: eager, lesson 14's packed weights
        engines = {"eager, packed": build_engine(model, config(), use_graph=False), **engines}
    step_latency(engines)


if __name__ == "__main__":
    main()
