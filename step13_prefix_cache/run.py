"""Lesson 13: requests that share a long system prompt, served with and without the prefix cache."""
from __future__ import annotations

import statistics

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step12_paged_attention.engine import PagedEngine
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingEngine

SYSTEM = (
    "You are the help desk assistant of the Riverside Public Library. Answer the visitor's question "
    "in two or three friendly sentences, using only the facts below. If the facts do not cover the "
    "question, say so and suggest asking a librarian at the front desk.\n\n"
    "Opening hours: the library is open from nine in the morning to eight in the evening on weekdays, "
    "from ten to five on Saturdays, and from noon to four on Sundays. It is closed on public holidays. "
    "The reading room on the second floor closes thirty minutes before the rest of the building.\n\n"
    "Membership: anyone who lives, works or studies in the city can join for free. To join, bring a "
    "photo identity card and a document with your address, such as a recent bill. Children under "
    "twelve need a parent or guardian to sign the form. A membership card is valid for three years "
    "and can be renewed at any desk.\n\n"
    "Borrowing: members may borrow up to fifteen items at a time. Books can be kept for three weeks, "
    "films and music for one week, and magazines for one week. Every item can be renewed twice, online "
    "or by phone, unless another member has reserved it. Late returns cost twenty cents per day for "
    "each book, with a maximum of five euros per item. Lost or damaged items must be paid for at the "
    "replacement price.\n\n"
    "Services: the library has forty public computers, free wireless internet, printers and a scanner. "
    "Printing costs ten cents per page in black and white and fifty cents in colour. Study rooms for "
    "two to six people can be booked up to one week in advance, for at most three hours a day. There "
    "is a story hour for young children every Wednesday at four, and a book club for adults on the "
    "first Thursday of each month at seven in the evening.\n\n"
    "Access: the building has a ramp at the main entrance, a lift to every floor and accessible "
    "toilets on the ground floor. Bicycles can be parked in front of the building. The nearest bus "
    "stop is Market Square, served by lines 4 and 12. There is no car park, but the city garage on "
    "Mill Street is a five minute walk away."
)

QUESTIONS = ["When is the library open on Sunday?", "How do I become a member?",
             "How many books can I borrow?", "What happens if I return a book late?",
             "Can I print documents here?", "Is there anything for small children?",
             "How do I get to the library by bus?", "Can I book a room to study with friends?",
             "Is the building accessible by wheelchair?", "How long can I keep a film?"]


def serve(engine, prompts, params, every: int):
    """Online arrivals: a new request every `every` engine steps; returns the sequences.

    Arrivals are counted in steps, not seconds, so both engines see exactly the same schedule.
    """
    seqs, tick = [], 0
    while len(seqs) < len(prompts) or engine.has_unfinished():
        if len(seqs) < len(prompts) and tick % every == 0:
            seqs.append(engine.add_request(prompts[len(seqs)], params))   # arrival_time = now
        if engine.has_unfinished():
            engine.step()
        tick += 1
    return seqs


class CountTokens:
    """Mixed into an engine: counts every token a step feeds through the model."""
    tokens_computed = 0

    def make_attention(self, batch):
        self.tokens_computed += batch.total_tokens
        return super().make_attention(batch)


class CountingPagedEngine(CountTokens, PagedEngine):
    pass


class CountingPrefixCachingEngine(CountTokens, PrefixCachingEngine):
    pass


def served(engine_class, model, config, prompts, params, every: int):
    """A variant for `compare`: a fresh engine every run, so the cache starts empty each time."""
    def run() -> dict:
        engine = engine_class(model, config)
        seqs = serve(engine, prompts, params, every)
        return dict(seqs=seqs, computed=engine.tokens_computed, steps=engine.num_steps,
                    bm=engine.scheduler.block_manager)       # small: block ids and counters, not the pool
    return run


def ttft_figures(seqs) -> dict[str, float]:
    ttft = [s.token_times[0] - s.arrival_time for s in seqs]
    return {"mean": statistics.mean(ttft), "median": statistics.median(ttft),
            "first": ttft[0], "later": statistics.mean(ttft[1:])}


def ms(seconds: float) -> str:
    return f"{1000 * seconds:7.0f} ms"


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--every", type=int, default=6, help="engine steps between two arrivals")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    prompts = [chat_prompt_ids(tok, q, system=SYSTEM) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    shared = next(i for i in range(min(map(len, prompts))) if len({pr[i] for pr in prompts}) > 1)
    bs = args.block_size
    print(f"{len(prompts)} requests: the same system prompt + a different question; prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, the first {shared} identical "
          f"({shared // bs} full blocks of {bs})")
    print(f"one request arrives every {args.every} engine steps; greedy, max_tokens={args.max_tokens}\n")

    config = PagedSchedulerConfig(max_num_seqs=len(prompts), block_size=bs, kv_cache_bytes=args.kv_cache_mib * 2**20)
    # A short untimed run of each (2 requests), then two rounds taking turns: a full warm-up
    # round would push the script past two minutes on 2 cores.
    for cls in (CountingPagedEngine, CountingPrefixCachingEngine):
        served(cls, model, config, prompts[:2], params, args.every)()
    runs = compare({"without cache": served(CountingPagedEngine, model, config, prompts, params, args.every),
                    "with cache": served(CountingPrefixCachingEngine, model, config, prompts, params, args.every)},
                   repeats=args.repeats or 2, warmup=False)
    plain, cached = runs["without cache"].result, runs["with cache"].result

    bm = cached["bm"]
    prompt_tokens = sum(map(len, prompts))
    print(f"prefix cache: hit rate {100 * bm.hit_rate:.1f}% ({bm.hit_tokens} of {bm.query_tokens} prompt tokens "
          f"found in cached blocks)")
    print(f"tokens through the model: {plain['computed']} without the cache, {cached['computed']} with it "
          f"(difference {plain['computed'] - cached['computed']}; hit tokens {bm.hit_tokens})")
    print(f"prompt tokens computed: {prompt_tokens} without, {prompt_tokens - bm.hit_tokens} with "
          f"-> {100 * bm.hit_tokens / prompt_tokens:.1f}% of the prefill work saved\n")

    for name, timing in runs.items():
        per_run = [ttft_figures(r["seqs"]) for r in timing.results]
        mid = {k: statistics.median(f[k] for f in per_run) for k in per_run[0]}
        print(f"TTFT {name:<13}: mean {ms(mid['mean'])}, median {ms(mid['median'])}, "
              f"first request {ms(mid['first'])}, later requests mean {ms(mid['later'])}")
    print(f"  (each figure the median over {len(per_run)} runs)")
    print(f"total time: {runs['without cache'].describe()} without, {runs['with cache'].describe()} with "
          f"({plain['steps']} and {cached['steps']} engine steps)")
    print(f"the cache made the run {format_ratio(runs['without cache'], runs['with cache'])}")
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(plain["seqs"], cached["seqs"]))
    print(identity_line("outputs, with vs without the cache", same, len(prompts), dtype))
    print(f"\nQ: {QUESTIONS[1]}\nA: {tok.decode(cached['seqs'][1].output_token_ids, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
