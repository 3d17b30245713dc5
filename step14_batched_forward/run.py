"""Lesson 14: one batched forward (no per-sequence loop) vs lesson 13's engine, same workload.

Three runs: lesson 13; lesson 14 in plain torch (gather + matmul attention); lesson 14 with
its paged decode kernel and pre-packed weights. The last one packs the model's weights in
place, so it runs last.
"""
from __future__ import annotations

import random
import time

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.lesson import start_lesson
from minivllm_support.models import chat_prompt_ids
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingEngine
from step14_batched_forward.engine import BatchedEngine

TOPICS = ["the sea", "a cat", "Paris", "the moon", "coffee", "a robot", "winter", "music",
          "a library", "the desert", "trains", "a garden", "chess", "rain", "a violin", "bread"]


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    dtype, folder, model, tok = start_lesson(args)
    rng = random.Random(0)
    prompts = [chat_prompt_ids(tok, rng.choice(["Write a short poem about {}.", "Describe {} in detail.",
                                                "Explain {} to a child."]).format(TOPICS[i % len(TOPICS)]))
               for i in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.choice([32, 48, 64, 96]), ignore_eos=True)
              for _ in prompts]
    n_out = sum(sp.max_tokens for sp in params)
    config = PagedSchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
                                  kv_cache_bytes=512 * 2**20)
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {n_out} output tokens "
          f"(ignore_eos), max_num_seqs={args.max_num_seqs}\n")
    results = {}
    runs = [("lesson 13 (attention loops over sequences)", PrefixCachingEngine, {}),
            ("lesson 14, torch only (gather + matmul)   ", BatchedEngine, dict(use_kernel=False, pack_weights=False)),
            ("lesson 14, decode kernel + packed weights ", BatchedEngine, {})]
    for name, cls, options in runs:
        engine = cls(model, config, **options)
        t0 = time.perf_counter()
        seqs = engine.generate(prompts, params)
        secs = time.perf_counter() - t0
        results[name] = (secs, [s.output_token_ids for s in seqs])
        print(f"{name}: {secs:6.2f} s, {n_out / secs:6.1f} output tok/s, {engine.num_steps} steps")
    (t13, a), (t_torch, _), (t14, b) = results.values()
    print(f"\nspeed-up over lesson 13: {t13 / t_torch:.2f}x torch only, {t13 / t14:.2f}x with kernel and packing")
    if not engine.use_kernel or not engine.num_packed:
        print(f"(kernel in use: {engine.use_kernel}; linears packed: {engine.num_packed} - see the README for why not)")
    print(identity_line("outputs of lesson 13 and lesson 14", sum(x == y for x, y in zip(a, b)), len(a), dtype))
    print(f"\nengine counters after the run: {engine.stats()}")


if __name__ == "__main__":
    main()
