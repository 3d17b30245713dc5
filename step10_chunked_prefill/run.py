"""Lesson 10: how long running requests stall when a long prompt arrives, with and without chunks."""
from __future__ import annotations

import statistics

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.lesson import start_lesson
from minivllm_support.models import chat_prompt_ids
from step06_sampler.params import SamplingParams
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import SchedulerConfig
from step10_chunked_prefill.engine import ChunkedPrefillEngine

SHORT = ["Write a poem about autumn.", "Describe a busy market.", "Tell a story about a fox.",
         "Explain how bread is made."]


def run(engine: LLMEngine, shorts, long_prompt, arrive_at: int, decode_tokens: int):
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
    ttft = 1e3 * (long_seq.token_times[0] - long_seq.arrival_time)
    return seqs, long_seq, gaps, ttft


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--long-tokens", type=int, default=1500, help="length of the prompt that arrives")
    p.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens with chunking")
    p.add_argument("--decode-tokens", type=int, default=48)
    args = p.parse_args()
    dtype, folder, model, tok = start_lesson(args)
    shorts = [chat_prompt_ids(tok, q) for q in SHORT]
    filler = tok.encode(" The quick brown fox jumps over the lazy dog near the quiet river bank." * 200,
                        add_special_tokens=False)
    long_prompt = filler[: args.long_tokens]
    print(f"{len(shorts)} requests decode {args.decode_tokens} tokens each; after 8 steps a "
          f"{len(long_prompt)}-token prompt arrives.\n")

    results = {}
    for name, engine in [
        ("lesson 09, whole prompt in one step", LLMEngine(model, SchedulerConfig(max_num_batched_tokens=4096))),
        (f"lesson 10, chunks of <= {args.chunk} tokens", ChunkedPrefillEngine(model, SchedulerConfig(max_num_batched_tokens=args.chunk))),
    ]:
        seqs, long_seq, gaps, ttft = run(engine, shorts, long_prompt, 8, args.decode_tokens)
        results[name] = [s.output_token_ids for s in seqs] + [long_seq.output_token_ids]
        print(f"{name}:\n  gap between tokens of running requests: median {statistics.median(gaps):6.1f} ms, "
              f"p99 {p99(gaps):7.1f} ms, worst {max(gaps):7.1f} ms")
        print(f"  long prompt: time to first token {ttft:7.1f} ms, engine steps {engine.num_steps}")
    a, b = results.values()
    print("\n" + identity_line("outputs with and without chunking", sum(x == y for x, y in zip(a, b)), len(a), dtype))


if __name__ == "__main__":
    main()
