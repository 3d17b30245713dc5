"""Advanced lesson 17: logits processors on the real checkpoint.

    python advanced/adv17_logits_processors/run.py                 # the embedded SmolLM2 (or --model FOLDER)
    python advanced/adv17_logits_processors/run.py --repeats 1     # the short mode

Sentiment classification by restricted next-token scoring (allowed_token_ids + the raw logprobs),
min_tokens holding EOS back, what the processors cost per engine step (same batch with and
without), and what skipping the argmax-invariant ones saves when every row is greedy.
"""
from __future__ import annotations

import torch

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from minivllm_support.timing import compare, format_ratio

from advanced.adv17_logits_processors.engine import ProcessorLLM
from advanced.adv17_logits_processors.params import SamplingParams

REVIEWS = [("An absolute delight from start to finish, I loved every minute.", "positive"),
           ("The food was cold and the waiter was rude.", "negative"),
           ("Best purchase I have made this year, it works perfectly.", "positive"),
           ("It broke after two days and support never answered.", "negative"),
           ("A warm, funny and beautifully acted film.", "positive"),
           ("Boring, far too long, and the ending made no sense.", "negative"),
           ("The hotel staff were kind and the room was spotless.", "positive"),
           ("I want my money back; this was a waste of time.", "negative")]
LABELS = (" positive", " negative")          # what follows "Sentiment:" in the examples
# Two worked examples, then the review: a small model follows a pattern far better than an
# instruction (the same reviews asked zero-shot get a near coin-flip from SmolLM2-135M).
SHOTS = ("Review: The staff were friendly and helpful.\nSentiment: positive\n\n"
         "Review: The screen cracked on the first day.\nSentiment: negative\n\n")


def main() -> None:
    p = base_parser(__doc__)
    args = p.parse_args()
    setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    # enforce_eager: lesson 16's recorded decode steps take minutes to build on a small CPU and
    # are not what this lesson is about.
    with ProcessorLLM(folder, dtype=args.dtype, max_num_seqs=16, enforce_eager=True) as llm:
        classify(llm)
        min_tokens(llm)
        cost(llm, args.repeats or 3)
        skip(llm, args.repeats or 3)


def classify(llm: ProcessorLLM) -> None:
    ids = [llm.tokenizer.encode(w, add_special_tokens=False) for w in LABELS]
    assert all(len(i) == 1 for i in ids), f"each label must be one token here, got {ids}"
    label_ids = [i[0] for i in ids]
    print(f"== sentiment by restricted next-token scoring: allowed_token_ids = {dict(zip(LABELS, label_ids))}, "
          "one greedy token after a two-example prompt")
    scores: dict[int, torch.Tensor] = {}

    def record(k: int):
        # A per-request processor: after the allowed-ids mask the two labels keep their raw
        # logits, so a softmax over them is the model's P(label | one of the labels).
        def fn(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            scores[k] = row[label_ids].log_softmax(-1).exp()
            return row
        return fn

    prompts = [f"{SHOTS}Review: {r}\nSentiment:" for r, _ in REVIEWS]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    restricted = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                       allowed_token_ids=label_ids, logits_processors=[record(k)])
                                        for k in range(len(prompts))], use_tqdm=False)
    right = parseable = 0
    print(f"  {'review':44} {'truth':9} {'free (3 tokens)':17} {'pick':9} raw logprob (rank)  P(pick | labels)")
    for k, ((review, truth), f, r) in enumerate(zip(REVIEWS, free, restricted)):
        c = r.outputs[0]
        pick = llm.tokenizer.decode(c.token_ids).strip()
        raw = c.logprobs[0][c.token_ids[0]]
        answer = f.outputs[0].text
        parseable += answer.split("\n")[0].strip() in (w.strip() for w in LABELS)
        right += pick == truth
        print(f"  {review[:43]:44} {truth:9} {answer!r:17} {pick:9} {raw.logprob:8.2f} ({raw.rank:5})  "
              f"{float(scores[k][[w.strip() for w in LABELS].index(pick)]):.3f}")
    print(f"  restricted picks right: {right}/{len(REVIEWS)}; free answers that are exactly a label: "
          f"{parseable}/{len(REVIEWS)}")
    print("  the logprobs are the model's raw ones (as vLLM reports them): the mask decides what can be\n"
          "  picked, not what the client is told the model thought\n")


def min_tokens(llm: ProcessorLLM) -> None:
    q = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    print(f"== min_tokens on {q[0]['content']!r} (greedy, max_tokens 24): EOS is masked until then")
    outs = llm.chat([q] * 3, [SamplingParams(temperature=0, max_tokens=24, min_tokens=m) for m in (0, 8, 16)],
                    use_tqdm=False)
    for m, o in zip((0, 8, 16), outs):
        c = o.outputs[0]
        print(f"  min_tokens {m:2}: {len(c.token_ids):2} tokens, {c.finish_reason:6} {c.text!r}")
    print()


def _run(llm: ProcessorLLM, prompts, params):
    """One batch; returns (outputs, seconds in the processors, sampler steps) for this run."""
    s = llm.sampler
    t0, n0 = s.processor_seconds, s.steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, s.processor_seconds - t0, s.steps - n0


def _line(t) -> str:
    """Median and range of the whole runs; per step, the fastest run (the least disturbed on a
    shared machine) and the least time the processors took in any run."""
    steps = t.result[2]
    in_procs = min(secs / max(n, 1) for _, secs, n in t.results)
    return (f"{t.describe()}; fastest {1000 * t.best / steps:.1f} ms/step over {steps} steps, "
            f"in the processors {1000 * in_procs:.2f} ms/step")


def cost(llm: ProcessorLLM, repeats: int) -> None:
    n, tokens = 16, 32
    prompts = [llm.encode(f"Story number {i}: once upon a time") for i in range(n)]
    allowed = list(range(0, llm.vocab_size, 4))                       # a quarter of the vocabulary
    plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True) for i in range(n)]
    every = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True, min_tokens=tokens // 2, stop_token_ids=[1],
                            logit_bias={11: -5.0, 13: 2.0, 30: 1.0}, allowed_token_ids=allowed, epsilon_cutoff=1e-4,
                            logits_processors=[lambda out, row: row]) for i in range(n)]
    print(f"== what the processors cost: {n} sampled requests x {tokens} tokens, the same batch, taking turns")
    print("   (every row: min_tokens (stop token 1, which the allowed ids exclude), logit_bias, allowed_token_ids\n"
          "    (every 4th id), epsilon_cutoff and a no-op callable)")
    runs = compare({"no processors": lambda: _run(llm, prompts, plain),
                    "all processors": lambda: _run(llm, prompts, every)}, repeats=repeats)
    for name, t in runs.items():
        print(f"  {name:15}: {_line(t)}")
    print(f"  all processors / none, whole run: {format_ratio(runs['all processors'], runs['no processors'], word='')}\n")


def skip(llm: ProcessorLLM, repeats: int) -> None:
    n, tokens = 16, 32
    prompts = [llm.encode(f"Recipe number {i}: first, take") for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, epsilon_cutoff=0.01)
    print(f"== the argmax-invariant skip: {n} greedy requests x {tokens} tokens with epsilon_cutoff 0.01 "
          "(it cannot change an argmax)")

    def run(skip_it: bool):
        llm.sampler.skip_argmax_invariant = skip_it
        try:
            return _run(llm, prompts, params)
        finally:
            llm.sampler.skip_argmax_invariant = True
    runs = compare({"skipped": lambda: run(True), "applied": lambda: run(False)}, repeats=repeats)
    for name, t in runs.items():
        print(f"  {name:8}: {_line(t)}")
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(runs["skipped"].result[0], runs["applied"].result[0]))
    print(f"  identical outputs: {same}/{n}")
    print(f"  applied / skipped, whole run: {format_ratio(runs['applied'], runs['skipped'], word='')}")


if __name__ == "__main__":
    main()
