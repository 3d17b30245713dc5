"""Timing decode steps of whole engines, side by side: fill an engine with sequences that are
all decoding, then let several engines take turns. Lesson 16's bench.py and run.py are the first
to compare engines step by step; later lessons' benches import this too.
"""
from __future__ import annotations

import random
import time

from minivllm_support.workloads import time_steps
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig


def fill(engine, batch: int, context: int, max_tokens: int, seed: int = 0) -> None:
    """Start `batch` sequences of about `context` tokens and run until every one is decoding."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Prompts share all but their last 8 tokens: the first computes the prefix, the others hit the
    # prefix cache (lesson 13), so setting up 64 x 360 tokens costs one prefill. Each sequence still
    # reads all its keys in every decode step: the step's work is as with distinct prompts.
    prefix = [rng.randrange(1000, vocab - 1000) for _ in range(context - 8)]
    seqs: list = []
    for group in (1, batch - 1):
        seqs += [engine.add_request(prefix + [rng.randrange(1000, vocab - 1000) for _ in range(8)], params)
                 for _ in range(group)]
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
            engine.step()                              # prefill, and each prompt's first token
    engine.step()                                      # one decode step untimed (first touch)


def step_turns(engines: dict, batch: int, context: int, steps: int, rounds: int,
               drain: bool = False) -> dict[str, float]:
    """Best milliseconds per decode step of each engine: each is filled with `batch` sequences
    of ~`context` tokens, then the engines take turns `rounds` times, `steps` steps a turn.
    drain: finish the sequences afterwards, so the next call starts from empty engines."""
    for engine in engines.values():
        fill(engine, batch, context, max_tokens=(rounds + 1) * steps + 8)
    best = {name: float("inf") for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            best[name] = min(best[name], time_steps(engine, steps))
    for engine in engines.values() if drain else ():
        while engine.has_unfinished():
            engine.step()
    return best


def make_engine(model, build, options: dict, max_num_seqs: int = 64, kv_gib: float = 3.5):
    """An engine from `build(model, config, **options)` (a lesson's build_engine, or an engine
    class), and the seconds building it took (recording buckets, compiling, packing)."""
    config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                  kv_cache_bytes=int(kv_gib * 2**30))
    t0 = time.perf_counter()
    engine = build(model, config, **options)
    return engine, time.perf_counter() - t0
