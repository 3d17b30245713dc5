"""Advanced lesson 02: penalties, logit_bias, bad words and beam search on the real checkpoint.

    python advanced/adv02_sampling/run.py                 # the embedded SmolLM2 (or --model FOLDER)
    python advanced/adv02_sampling/run.py --dtype fp32 --threads 2

A repetitive greedy answer with and without each penalty, a banned word, logit_bias forcing a
token, beam search against greedy with their cumulative logprobs, and what the penalties cost.
"""
from __future__ import annotations

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from minivllm_support.timing import compare, format_ratio

from advanced.adv02_sampling.beam_search import BeamSearchParams
from advanced.adv02_sampling.engine import AdvLLM, bad_words_to_ids
from advanced.adv02_sampling.params import SamplingParams


def main() -> None:
    p = base_parser(__doc__)
    args = p.parse_args()
    setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    # enforce_eager: lesson 16's fast-path compiled decode steps take minutes to record on a small CPU
    # and are not what this lesson is about.
    with AdvLLM(folder, dtype=args.dtype, max_num_seqs=16, enforce_eager=True) as llm:
        penalties(llm)
        banned(llm)
        biased(llm)
        beams(llm)
        cost(llm, args.repeats or 3)


def _distinct(token_ids: list[int]) -> str:
    return f"{len(set(token_ids))}/{len(token_ids)} distinct tokens"


def penalties(llm: AdvLLM) -> None:
    prompt = "The list of colors: red, blue, red, blue,"
    print(f"== one repetitive greedy continuation of {prompt!r}, 24 tokens, and each penalty")
    variants = {
        "greedy, no penalty": {},
        "repetition_penalty=1.3": {"repetition_penalty": 1.3},
        "frequency_penalty=0.5": {"frequency_penalty": 0.5},
        "presence_penalty=1.0": {"presence_penalty": 1.0},
        "frequency=-0.5 (rewards repeats)": {"frequency_penalty": -0.5},
    }
    outs = llm.generate([prompt] * len(variants),
                        [SamplingParams(temperature=0, max_tokens=24, **kw) for kw in variants.values()],
                        use_tqdm=False)                    # one batch: each row with its own settings
    for name, o in zip(variants, outs):
        c = o.outputs[0]
        print(f"  {name:33}: {c.text!r}  ({_distinct(c.token_ids)})")
    print()


def banned(llm: AdvLLM) -> None:
    q = [{"role": "user", "content": "What is the capital of France?"}]
    print("== bad_words=['Paris']: every tokenization of the word ('Paris', ' Paris') can never be completed")
    plain, ban = llm.chat([q, q], [SamplingParams(temperature=0, max_tokens=30),
                                   SamplingParams(temperature=0, max_tokens=30, bad_words=["Paris"])], use_tqdm=False)
    words = bad_words_to_ids(llm.tokenizer, ["Paris"])
    print(f"  bad words as token ids: {words} = {[llm.tokenizer.convert_ids_to_tokens(w) for w in words]}")
    print(f"  plain : {plain.outputs[0].text!r}")
    print(f"  banned: {ban.outputs[0].text!r}\n")


def biased(llm: AdvLLM) -> None:
    q = [{"role": "user", "content": "Is water wet? Answer yes or no."}]
    yes, no = llm.encode("Yes")[0], llm.encode("No")[0]
    print(f"== logit_bias on the first word of {q[0]['content']!r} ('Yes' is id {yes}, 'No' is id {no})")
    settings = {"no bias": None, "{No: -100}": {no: -100.0}, "{Yes: +2}": {yes: 2.0}, "{Yes: +100}": {yes: 100.0}}
    outs = llm.chat([q] * len(settings), [SamplingParams(temperature=0, max_tokens=12, logit_bias=b, logprobs=1)
                                          for b in settings.values()], use_tqdm=False)
    for name, o in zip(settings, outs):
        c = o.outputs[0]
        raw = c.logprobs[0][c.token_ids[0]]
        print(f"  {name:12}: {c.text!r}  (first token: raw logprob {raw.logprob:.2f}, rank {raw.rank} "
              f"in the model's own distribution)")
    print("  -100 removes a token, a small bias tips a close call, +100 wins every step, not just the first\n")


def beams(llm: AdvLLM) -> None:
    questions = ["Write a haiku about the sea.", "What is 2+2?", "Give me a synonym for happy."]
    k, n = 4, 24
    print(f"== beam search (beam_width {k}, max_tokens {n}, length_penalty 1, HF's early_stopping=False) vs greedy")
    convs = [[{"role": "user", "content": q}] for q in questions]
    greedy = llm.chat(convs, SamplingParams(temperature=0, max_tokens=n, logprobs=0), use_tqdm=False)
    hits = llm.engine.stats().prefix_cache_hits
    queries = llm.engine.stats().prefix_cache_queries
    results = llm.beam_search([{"prompt_token_ids": llm.chat_prompt_ids(c)} for c in convs], BeamSearchParams(k, n))
    for q, g, bs in zip(questions, greedy, results):
        c = g.outputs[0]
        print(f"Q: {q}\n  greedy  : {c.text!r}\n            cumulative logprob {c.cumulative_logprob:.3f} "
              f"over {len(c.token_ids)} tokens")
        for i, b in enumerate(bs):
            print(f"  beam {i}  : {b.text!r}\n            cumulative logprob {b.cum_logprob:.3f} over "
                  f"{len(b.token_ids)} tokens, score {b.score:.4f}, {b.finish_reason}")
    s = llm.engine.stats()
    print(f"  prefix cache during beam search: {s.prefix_cache_hits - hits} of "
          f"{s.prefix_cache_queries - queries} looked-up tokens reused (each beam re-enters as a new request)\n")


def cost(llm: AdvLLM, repeats: int = 3) -> None:
    prompts = [llm.encode(f"Story number {i}: once upon a time") for i in range(8)]
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    pen = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.2,
                         frequency_penalty=0.3, presence_penalty=0.3, logit_bias={5: 1.0})
    runs = compare({"plain": lambda: llm.generate(prompts, plain, use_tqdm=False),
                    "penalties": lambda: llm.generate(prompts, pen, use_tqdm=False)}, repeats=repeats)
    print("== what the penalties cost: 8 requests x 32 tokens, taking turns")
    for name, t in runs.items():
        print(f"  {name:10}: {t.describe()}")
    print(f"  with penalties / plain time: {format_ratio(runs['penalties'], runs['plain'], word='')}")


if __name__ == "__main__":
    main()
