"""Lesson 14: one batched forward (no per-sequence loop) vs lesson 13's engine, same workload.

Three variants: lesson 13; lesson 14 in plain torch (gather + matmul attention); lesson 14
with its paged decode kernel and pre-packed weights. Packing makes a packed copy of the model
(`pack_linears`), made once here, so the three can take turns on the same weights.
"""
from __future__ import annotations

import random

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingEngine
from step14_batched_forward.engine import BatchedEngine
from step14_batched_forward.packed_linear import pack_linears

TOPICS = ["the sea", "a cat", "Paris", "the moon", "coffee", "a robot", "winter", "music",
          "a library", "the desert", "trains", "a garden", "chess", "rain", "a violin", "bread"]


def served(engine_class, model, config, options: dict, prompts, params):
    """A variant for `compare`: a fresh engine every run, so the prefix cache starts empty each time."""
    def run() -> dict:
        engine = engine_class(model, config, **options)
        outputs = [s.output_token_ids for s in engine.generate(prompts, params)]
        stats = engine.stats() if isinstance(engine, BatchedEngine) else None
        return dict(outputs=outputs, steps=engine.num_steps, stats=stats)
    return run


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, _, model, tok = start_lesson(args)
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
    # Packed once, outside the timed runs: each engine would otherwise pack its own copy.
    packed_model = pack_linears(model)
    first = BatchedEngine(packed_model, config, pack_weights=False)
    use_kernel, num_packed = first.use_kernel, first.num_packed
    del first
    torch_only = dict(use_kernel=False, pack_weights=False)
    variants = [("lesson 13 (attention loops over sequences)", PrefixCachingEngine, model, {}),
                ("lesson 14, torch only (gather + matmul)   ", BatchedEngine, model, torch_only),
                ("lesson 14, decode kernel + packed weights ", BatchedEngine, packed_model, dict(pack_weights=False))]
    # A short untimed run of each (4 requests), then two rounds taking turns: a full warm-up
    # round would push the script past two minutes on 2 cores.
    for _, cls, m, kw in variants:
        served(cls, m, config, kw, prompts[:4], params[:4])()
    runs = compare({name: served(cls, m, config, kw, prompts, params) for name, cls, m, kw in variants},
                   repeats=args.repeats or 2, warmup=False)
    for name, timing in runs.items():
        print(f"{name}: {timing.describe()}, {n_out / timing.median:6.1f} output tok/s, "
              f"{timing.result['steps']} steps")
    t13, t_torch, t14 = runs.values()
    print(f"\nspeed-up over lesson 13: {format_ratio(t13, t_torch, word='torch only')}, "
          f"{format_ratio(t13, t14, word='with kernel and packing')}")
    if not use_kernel or not num_packed:
        print(f"(kernel in use: {use_kernel}; linears packed: {num_packed} - see the README for why not)")
    a, b = t13.result["outputs"], t14.result["outputs"]
    print(identity_line("outputs of lesson 13 and lesson 14", sum(x == y for x, y in zip(a, b)), len(a), dtype))
    print(f"\nengine counters after the run: {t14.result['stats']}")


if __name__ == "__main__":
    main()
