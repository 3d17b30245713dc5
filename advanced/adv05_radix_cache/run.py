"""Advanced lesson 05: the radix cache against lesson 13's block hashing, on a multi-turn chat
and on few-shot prompts whose examples come in varying order."""
from __future__ import annotations

import random

from minivllm_support.cli import base_parser, identity_line
from step04_transformer.start import start_lesson
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine, cpu_fast_path
from advanced.adv05_radix_cache.engine import build_radix_engine

CONVERSATIONS = [
    ["I want to bake bread at home. What do I need?", "How long should the dough rest?",
     "Can I use whole wheat flour instead?", "Thanks! Any tip for a crispy crust?"],
    ["What is a prime number?", "Is 91 a prime number?", "What is the next prime after 91?",
     "Give me a quick way to test small numbers."],
    ["Suggest a name for a grey cat.", "Something shorter, please.", "Why do cats purr?",
     "Do cats like to be brushed?"],
]

HEADER = "Classify the sentiment of each product review as positive or negative.\n\n"
EXAMPLES = [
    ("The blender is loud but it crushes ice in seconds and cleans up easily.", "positive"),
    ("Stopped charging after two weeks and support never answered my emails.", "negative"),
    ("Comfortable shoes, true to size, and they still look new after a month of running.", "positive"),
    ("The lid cracked the first time I put it in the dishwasher.", "negative"),
    ("Battery lasts all weekend and the screen is bright even in sunlight.", "positive"),
    ("Smells of plastic and the zipper broke on the first trip.", "negative"),
]
QUERIES = ["Arrived quickly and works exactly as described.", "Too small and the colour is not as shown.",
           "My kids love it and use it every day.", "It stopped working after one use.",
           "Great value for the price.", "The instructions were missing and a screw was broken.",
           "Soft, warm and well made.", "Returned it: the sound is terrible.",
           "Easy to set up, even for me.", "Paint peeled off within days."]


def chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def few_shot_prompts(tok, seed: int = 0) -> list[list[int]]:
    """Every request: the header, four of the six examples in a random order, its own review."""
    rng = random.Random(seed)
    prompts = []
    for q in QUERIES:
        shots = rng.sample(EXAMPLES, 4)
        text = HEADER + "".join(f"Review: {r}\nSentiment: {s}\n\n" for r, s in shots) + f"Review: {q}\nSentiment:"
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


def chat_run(engine, tok, max_tokens: int) -> list[list[int]]:
    """Turn by turn: each conversation's next prompt is everything said so far + a new message."""
    histories: list[list[dict]] = [[] for _ in CONVERSATIONS]
    outputs = []
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    for turn in range(len(CONVERSATIONS[0])):
        for h, conv in zip(histories, CONVERSATIONS):
            h.append({"role": "user", "content": conv[turn]})
        seqs = engine.generate([chat_ids(tok, h) for h in histories], sp)
        for h, s in zip(histories, seqs):
            h.append({"role": "assistant", "content": tok.decode(s.output_token_ids, skip_special_tokens=True)})
            outputs.append(s.output_token_ids)
    return outputs


def few_shot_run(engine, prompts: list[list[int]]) -> list[list[int]]:
    """One arrival per engine step, so later requests can reuse what earlier ones computed."""
    sp = SamplingParams(temperature=0, max_tokens=4)
    seqs = []
    for p in prompts:
        seqs.append(engine.add_request(p, sp))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs]


def variant(build, model, config, workload):
    """A fresh engine every run: each run starts from an empty cache."""
    def run() -> dict:
        engine = build(model, config, use_graph=False)
        outputs = workload(engine)
        stats, bm = engine.stats(), engine.scheduler.block_manager
        return dict(outputs=outputs, queries=stats.prefix_cache_queries, hits=stats.prefix_cache_hits,
                    computed=stats.prompt_tokens, copies=getattr(bm, "num_copies", 0))
    return run


def report(title: str, runs: dict, dtype) -> None:
    print(f"\n{title}")
    print(f"  {'engine':<24}{'hit rate':>9}{'prompt tokens reused':>24}{'prefill computed':>18}   wall time")
    for name, timing in runs.items():
        r = timing.result
        print(f"  {name:<24}{100 * r['hits'] / max(1, r['queries']):8.1f}%{r['hits']:>13} of {r['queries']:<8}"
              f"{r['computed']:>18}   {timing.describe()}")
    (n13, t13), (nrx, trx) = runs.items()
    a, b = t13.result, trx.result
    print(f"  the radix cache reused {b['hits'] - a['hits']} more prompt tokens and computed "
          f"{a['computed'] - b['computed']} fewer prefill tokens ({b['copies']} copy-on-write block copies)")
    print(f"  wall time: radix {format_ratio(t13, trx)} than block hashing")
    same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))
    print("  " + identity_line("outputs, radix vs block hashing", same, len(a["outputs"]), dtype))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=40, help="reply length cap in the chat")
    p.add_argument("--block-size", type=int, default=16)
    # fp32 by default: each chat reply becomes part of the next prompt, so both engines must
    # produce the same replies (bf16 rounds differently per batch shape) to face the same prompts.
    p.set_defaults(dtype="fp32")
    args = p.parse_args()
    args.repeats = args.repeats or 2
    dtype, folder, model, tok = start_lesson(args)
    config = PagedSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=args.block_size,
                                  kv_cache_bytes=256 * 2**20)
    engines = {f"lesson 13 (blocks of {args.block_size})": build_engine, "radix tree (tokens)": build_radix_engine}
    print(f"both engines: lesson 16's fast-path engine without graphs (use_graph=False), greedy; "
          f"only the block manager differs")
    model = cpu_fast_path(model)        # once: a fresh engine per run then has nothing left to transform

    chat = {name: variant(build, model, config, lambda e: chat_run(e, tok, args.max_tokens))
            for name, build in engines.items()}
    report(f"(a) multi-turn chat: {len(CONVERSATIONS)} conversations x {len(CONVERSATIONS[0])} turns, each "
           f"prompt = the conversation so far + a new message (max_tokens={args.max_tokens})",
           compare(chat, repeats=args.repeats), dtype)

    prompts = few_shot_prompts(tok)
    shots = {name: variant(build, model, config, lambda e: few_shot_run(e, prompts))
             for name, build in engines.items()}
    report(f"(b) few-shot: {len(prompts)} requests, 4 of {len(EXAMPLES)} shared examples in a random order "
           f"each, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, one arrival per step",
           compare(shots, repeats=args.repeats), dtype)


if __name__ == "__main__":
    main()
