"""Lesson 08: a padded batch of mixed requests vs the same requests one at a time."""
from __future__ import annotations

from minivllm_support.cli import base_parser, identity_line
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step07_kv_cache.generate import generate_cached
from step08_static_batching.batch import generate_static

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three colours.",
    "Explain in two sentences why the sky is blue, then say goodbye politely.",
    "What is 12 times 12?",
    "Give me a short motivational quote.",
    "Describe a cat to someone who has never seen one, in a few sentences.",
]
MAX_TOKENS = [12, 24, 48, 16, 64, 20, 32, 80]


def main() -> None:
    args = base_parser(__doc__).parse_args()
    dtype, folder, model, tok = start_lesson(args)
    eos = model.config.eos_token_ids
    prompts = [chat_prompt_ids(tok, q) for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]

    # One untimed run of each, then three rounds taking turns (~50 s in all on 2 cores).
    runs = compare({"one at a time": lambda: [generate_cached(model, ids, p, eos) for ids, p in zip(prompts, params)],
                    "static batch": lambda: generate_static(model, prompts, params, eos)}, repeats=args.repeats or 3)
    single, static = runs["one at a time"], runs["static batch"]
    singles = single.result
    batch, stats = static.result

    for q, o in zip(QUESTIONS, batch):
        print(f"Q: {q}\nA: {tok.decode(o.token_ids, skip_special_tokens=True).strip()!r} ({o.finish_reason})")
    n_tokens = sum(len(o.token_ids) for o in batch)
    lens = [len(p) for p in prompts]
    same = sum(a.token_ids == b.token_ids for a, b in zip(singles, batch))
    print(f"\n{len(prompts)} requests, prompts {min(lens)}-{max(lens)} tokens, "
          f"outputs {min(len(o.token_ids) for o in batch)}-{max(len(o.token_ids) for o in batch)} tokens")
    print(identity_line("to one-at-a-time (lesson 07)", same, len(prompts), dtype))
    print(f"token slots computed: {stats.slots}, useful: {stats.useful} -> "
          f"{100 * stats.wasted_share:.1f}% wasted on padding and finished rows")
    n_single = sum(len(o.token_ids) for o in singles)
    print(f"one at a time: {single.describe()}, {n_single / single.median:.1f} tok/s")
    print(f"static batch:  {static.describe()}, {n_tokens / static.median:.1f} tok/s")
    print(f"static batch {format_ratio(single, static)}")
    print(f"decode steps: {len(stats.step_seconds) - 1}, set by the longest request; "
          f"the shortest needed {min(len(o.token_ids) for o in batch) - 1}")


if __name__ == "__main__":
    main()
