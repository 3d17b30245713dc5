"""Lesson 10: how long running requests stall when a long prompt arrives, with and without chunks."""
from __future__ import annotations

import statistics

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare
from step06_sampler.params import SamplingParams
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import SchedulerConfig
from step10_chunked_prefill.engine import ChunkedPrefillEngine

SHORT = ["Write a poem about autumn.", "Describe a busy market.", "Tell a story about a fox.",
         "Explain how bread is made."]


def run(engine: LLMEngine, shorts, long_prompt, arrive_at: int, decode_tokens: int) -> dict:
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True))
            for p in shorts]
    long_seq = None
    steps = 0
    while engine.has_unfinished() or long_seq is None:
        if steps == arrive_at:
            long_seq = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()
        steps += 1
    gaps = [1e3 * (b - a) for s in seqs for a, b in zip(s.token_times, s.token_times[1:])]
    return {"outputs": [s.output_token_ids for s in seqs + [long_seq]], "steps": engine.num_steps,
            "median": statistics.median(gaps), "p99": p99(gaps), "worst": max(gaps),
            "ttft": 1e3 * (long_seq.token_times[0] - long_seq.arrival_time)}


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--long-tokens", type=int, default=1500, help="length of the prompt that arrives")
    p.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens with chunking")
    p.add_argument("--decode-tokens", type=int, default=48)
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    shorts = [chat_prompt_ids(tok, q) for q in SHORT]
    filler = tok.encode(" The quick brown fox jumps over the lazy dog near the quiet river bank." * 200,
                        add_special_tokens=False)
    long_prompt = filler[: args.long_tokens]
    print(f"{len(shorts)} requests decode {args.decode_tokens} tokens each; after 8 steps a "
          f"{len(long_prompt)}-token prompt arrives.\n")

    # One untimed run of each, then three rounds taking turns; each figure below is the median
    # of its three values (~50 s in all on 2 cores).
    def fresh(cls: type[LLMEngine], budget: int):
        """A new engine for every run, so that every run starts from the same empty state."""
        return lambda: run(cls(model, SchedulerConfig(max_num_batched_tokens=budget)),
                           shorts, long_prompt, 8, args.decode_tokens)

    runs = compare({"lesson 09, whole prompt in one step": fresh(LLMEngine, 4096),
                    f"lesson 10, chunks of <= {args.chunk} tokens": fresh(ChunkedPrefillEngine, args.chunk)},
                   repeats=args.repeats or 3)
    for name, timing in runs.items():
        mid = {k: statistics.median(r[k] for r in timing.results) for k in ("median", "p99", "worst", "ttft")}
        ttfts = [r["ttft"] for r in timing.results]
        print(f"{name} (median of {len(ttfts)} runs):\n  gap between tokens of running requests: "
              f"median {mid['median']:6.1f} ms, p99 {mid['p99']:7.1f} ms, worst {mid['worst']:7.1f} ms")
        print(f"  long prompt: time to first token {mid['ttft']:7.1f} ms (range {min(ttfts):.0f}-{max(ttfts):.0f}), "
              f"engine steps {timing.result['steps']}")
    a, b = (timing.result["outputs"] for timing in runs.values())
    print("\n" + identity_line("outputs with and without chunking", sum(x == y for x, y in zip(a, b)), len(a), dtype))


if __name__ == "__main__":
    main()
