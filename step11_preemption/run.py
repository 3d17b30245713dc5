"""Lesson 11: a workload bigger than the KV budget finishes anyway, by preempting and recomputing."""
from __future__ import annotations

from typing import Callable

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import SchedulerConfig
from step10_chunked_prefill.engine import ChunkedPrefillEngine
from step11_preemption.engine import PreemptingEngine
from step11_preemption.scheduler import PreemptionSchedulerConfig

QUESTIONS = ["Write a poem about autumn.", "Describe a busy market.", "Tell a story about a fox.",
             "Explain how bread is made.", "What makes a good friend?", "Describe the ocean at night.",
             "How do birds fly?", "Write a letter to a future self."]


def served(make_engine: Callable[[], LLMEngine], prompts, params) -> Callable[[], tuple]:
    """A variant for `compare`: a fresh engine every run (its build timed, as before), then the workload."""
    def run() -> tuple:
        engine = make_engine()
        return engine, engine.generate(prompts, params)
    return run


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-kv-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    prompts = [chat_prompt_ids(tok, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    peak = sum(len(p) + args.max_tokens - 1 for p in prompts)
    print(f"{len(prompts)} requests would hold {peak} tokens of KV at once; the budget is "
          f"{args.max_kv_tokens} tokens ({args.max_kv_tokens * model.config.kv_bytes_per_token / 2**20:.1f} MiB in bf16)\n")

    # One untimed run of each, then three rounds taking turns (~50 s in all on 2 cores).
    seats = dict(max_num_seqs=len(prompts), max_num_batched_tokens=256)
    runs = compare({"unconstrained": served(lambda: ChunkedPrefillEngine(model, SchedulerConfig(**seats)),
                                            prompts, params),
                    "budget": served(lambda: PreemptingEngine(model, PreemptionSchedulerConfig(
                        **seats, max_kv_tokens=args.max_kv_tokens)), prompts, params)}, repeats=args.repeats or 3)
    (free, ref), (tight, out) = runs["unconstrained"].result, runs["budget"].result

    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(ref, out))
    print(f"unconstrained: {runs['unconstrained'].describe()}, {free.num_steps} steps")
    print(f"budget {args.max_kv_tokens}:    {runs['budget'].describe()}, {tight.num_steps} steps, "
          f"{tight.scheduler.num_preemptions} preemptions "
          f"(per request: {[s.num_preemptions for s in out]})")
    print(f"time with the budget / without: {format_ratio(runs['budget'], runs['unconstrained'], word='')}")
    print(identity_line("outputs", same, len(out), dtype))
    try:
        tight.add_request(prompts[0], SamplingParams(max_tokens=args.max_kv_tokens))
    except ValueError as e:
        print(f"\nan impossible request is refused at once:\n  ValueError: {e}")


if __name__ == "__main__":
    main()
