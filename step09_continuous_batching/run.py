"""Lesson 09: continuous batching vs static batching on requests of mixed lengths."""
from __future__ import annotations

import random

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step08_static_batching.batch import generate_static
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import SchedulerConfig

TOPICS = ["the sea", "a cat", "Paris", "the moon", "coffee", "a robot", "winter", "music",
          "a library", "the desert", "trains", "a garden", "chess", "rain", "a violin", "bread"]


def workload(tok, n: int, seed: int = 0):
    """Mixed lengths on purpose: short and long answers side by side, as real traffic is."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        ask = rng.choice(["Say one word about {}.", "Write a short poem about {}.",
                          "Explain {} to a child in a few sentences."]).format(topic)
        prompts.append(chat_prompt_ids(tok, ask))
        params.append(SamplingParams(temperature=0, max_tokens=rng.choice([6, 12, 24, 48, 72]), ignore_eos=True))
    return prompts, params


def static_batches(model, prompts, params, batch: int):
    """Lesson 08, one static batch after the other; returns the outputs, wasted and all slots."""
    outs_all, wasted, slots = [], 0, 0
    for i in range(0, len(prompts), batch):
        outs, stats = generate_static(model, prompts[i:i + batch], params[i:i + batch])
        outs_all += outs
        slots += stats.slots
        wasted += stats.slots - stats.useful
    return outs_all, wasted, slots


def continuous(model, prompts, params, batch: int):
    """A fresh engine each run, so every run starts from the same empty state."""
    engine = LLMEngine(model, SchedulerConfig(max_num_seqs=batch))
    return engine.generate(prompts, params), engine.num_steps


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--batch", type=int, default=8, help="static batch size = max_num_seqs")
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    prompts, params = workload(tok, args.requests)
    n_out = sum(sp.max_tokens for sp in params)
    print(f"{args.requests} requests, max_tokens from {min(s.max_tokens for s in params)} to "
          f"{max(s.max_tokens for s in params)} (ignore_eos, so every request runs to its length), "
          f"{n_out} output tokens in all\n")

    # One untimed run of each, then two rounds taking turns: a third round would take the
    # script to ~100 s on 2 cores.
    runs = compare({"static": lambda: static_batches(model, prompts, params, args.batch),
                    "continuous": lambda: continuous(model, prompts, params, args.batch)}, repeats=args.repeats or 2)
    static, cont = runs["static"], runs["continuous"]
    static_out, wasted, slots = static.result
    seqs, num_steps = cont.result

    same = sum(a.token_ids == s.output_token_ids for a, s in zip(static_out, seqs))
    print(f"static batches of {args.batch}: {static.describe()}, {n_out / static.median:6.1f} tok/s, "
          f"{100 * wasted / slots:.0f}% of token slots wasted")
    print(f"continuous (max_num_seqs={args.batch}): {cont.describe()}, {n_out / cont.median:6.1f} tok/s, "
          f"{num_steps} engine steps")
    print(f"speed-up: {format_ratio(static, cont, word='')}")
    print(identity_line("outputs", same, len(seqs), dtype))
    out = seqs[1].output_token_ids
    eos = [i for i, t in enumerate(out) if t in model.config.eos_token_ids]
    print(f"\nsample (up to its first EOS; ignore_eos kept it going after): "
          f"{tok.decode(out[: eos[0] if eos else len(out)], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
