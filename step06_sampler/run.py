"""Lesson 06 demo: the sampler on a real next-token distribution, checked statistically.

    python step06_sampler/run.py [--model PATH] [--dtype bf16|fp32] [--threads N] [--draws N]
"""
from __future__ import annotations

import time

import torch

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import load_tokenizer, resolve_model
from step06_sampler import SamplingParams, Sampler, make_generator
from step06_sampler.stats import chi2_critical, frequency_test

PROMPT = "The capital of France is"
SETTINGS = [  # (column title, params) for the table in [1]
    ("greedy", SamplingParams(temperature=0.0)),
    ("T=1", SamplingParams()),
    ("T=0.5", SamplingParams(temperature=0.5)),
    ("T=1.5", SamplingParams(temperature=1.5)),
    ("top_k=5", SamplingParams(top_k=5)),
    ("top_p=0.9", SamplingParams(top_p=0.9)),
    ("min_p=0.1", SamplingParams(min_p=0.1)),
]
ALPHA = 0.01
CHUNK = 250  # rows per sampler call when drawing many samples


def next_token_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [1, V] for the token after `ids` (one forward pass)."""
    return model(input_ids=ids).logits[:, -1, :].float()


def draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n tokens from one request's own generator, as if it decoded n steps from the same logits."""
    gen = make_generator(params)
    out = [sampler(logits.expand(m, -1), [params] * m, [gen] * m)
           for m in [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])]
    return torch.cat(out)


def frequency_report(show, samples, target, title):
    res = frequency_test(samples, target)
    n = samples.numel()
    counts = torch.bincount(samples, minlength=target.numel())
    print(f"\n{title}")
    print(f"    {'token':<14}{'target p':>10}{'sampled':>10}{'count':>8}")
    for t in target.argsort(descending=True)[:8].tolist():
        if target[t] == 0:
            break
        print(f"    {show(t):<14}{float(target[t]):>10.4f}{int(counts[t]) / n:>10.4f}{int(counts[t]):>8}")
    kept = int((target > 0).sum())
    print(f"    tokens with p > 0: {kept}; categories tested: {len(res['observed'])} "
          f"(expected count >= 5 each, the rest pooled)")
    if res["df"] == 0:
        print("    only one token can be drawn: nothing to test")
    else:
        crit = chi2_critical(res["df"], ALPHA)
        verdict = "consistent with the target" if res["statistic"] < crit else "REJECTED"
        print(f"    chi-square = {res['statistic']:.2f}, df = {res['df']}, critical value at "
              f"alpha={ALPHA}: {crit:.2f}, p-value = {res['p_value']:.3f} -> {verdict}")
    print(f"    draws of tokens the filters removed: {res['impossible']}")


def generate(model, sampler, prompts_ids, params, steps):
    """A tiny decode loop, only to feed the sampler real logits step after step. Each sequence
    runs through the model on its own, with Hugging Face's KV cache (how a cache works is
    lesson 07); then all rows are sampled in ONE sampler call, the way an engine batches."""
    gens = [make_generator(p) for p in params]
    outs = [model(input_ids=ids, use_cache=True) for ids in prompts_ids]
    generated = [[] for _ in prompts_ids]
    for step in range(steps):
        logits = torch.cat([o.logits[:, -1, :].float() for o in outs])         # [B, V]
        tokens = sampler(logits, params, gens)
        for row, t in zip(generated, tokens.tolist()):
            row.append(t)
        if step + 1 < steps:
            outs = [model(input_ids=t.view(1, 1), past_key_values=o.past_key_values, use_cache=True)
                    for t, o in zip(tokens, outs)]
    return generated


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=10_000, help="samples for the frequency check")
    p.add_argument("--steps", type=int, default=12, help="tokens generated in the seed demo")
    args = p.parse_args()
    dtype = setup(args)
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    show = lambda i: repr(tok.decode([int(i)]))  # noqa: E731  repr shows leading spaces
    sampler = Sampler()

    ids = tok(PROMPT, return_tensors="pt").input_ids
    logits = next_token_logits(model, ids)                                        # [1, V]
    vocab = logits.shape[-1]
    print(f"model: {model_dir} ({dtype}, vocab {vocab})")
    print(f"prompt: {PROMPT!r} -> {ids.shape[1]} tokens; one forward pass gives the next-token logits")

    # [1] What each setting does to the distribution -----------------------------------
    probs = {name: sampler.probs(logits, [sp])[0] for name, sp in SETTINGS}
    top = probs["T=1"].argsort(descending=True)[:10].tolist()
    print("\n[1] probability of the 10 most likely tokens under each setting (0 = removed)")
    print(f"    {'token':<14}" + "".join(f"{name:>11}" for name, _ in SETTINGS))
    for t in top:
        print(f"    {show(t):<14}" + "".join(f"{float(probs[name][t]):>11.4f}" for name, _ in SETTINGS))
    print(f"    {'other tokens':<14}" + "".join(
        f"{max(0.0, float(probs[name].sum() - probs[name][top].sum())):>11.4f}" for name, _ in SETTINGS))
    print(f"    {'tokens kept':<14}" + "".join(f"{int((probs[name] > 0).sum()):>11}" for name, _ in SETTINGS))
    ent = {name: float(-(pr[pr > 0] * pr[pr > 0].log()).sum()) + 0.0 for name, pr in probs.items()}
    print(f"    {'entropy (nat)':<14}" + "".join(f"{ent[name]:>11.3f}" for name, _ in SETTINGS))

    # [2] Do the samples follow the distribution? ----------------------------------------
    print(f"\n[2] empirical check: {args.draws} draws from one seeded request, {CHUNK} rows per "
          f"sampler call, against the target from Sampler.probs")
    for sp, title in [(SamplingParams(seed=0), "T=1, whole vocabulary"),
                      (SamplingParams(temperature=1.5, top_k=12, top_p=0.85, seed=1),
                       "T=1.5, top_k=12, top_p=0.85")]:
        t0 = time.perf_counter()
        samples = draw(sampler, logits, sp, args.draws)
        secs = time.perf_counter() - t0
        frequency_report(show, samples, sampler.probs(logits, [sp])[0],
                         f"  {title} (seed {sp.seed}; drawn in {secs:.2f} s)")
    # Greedy: every draw is the argmax, no randomness used.
    g = sampler(logits.expand(100, -1), [SamplingParams(temperature=0.0)] * 100)
    print(f"\n  temperature=0: 100 of 100 draws are the argmax {show(logits.argmax())}: "
          f"{bool((g == logits.argmax()).all())}")

    # [3] Seeds: reproducible, and independent of the batch ------------------------------
    print(f"\n[3] seeds: generate {args.steps} tokens (T=1, top_p=0.95) with the real model")
    mine = SamplingParams(top_p=0.95, seed=42)
    run_a = generate(model, sampler, [ids], [mine], args.steps)[0]
    run_b = generate(model, sampler, [ids], [mine], args.steps)[0]
    run_c = generate(model, sampler, [ids], [SamplingParams(top_p=0.95, seed=43)], args.steps)[0]
    others = [tok("Once upon a time", return_tensors="pt").input_ids,
              tok("def fibonacci(n):", return_tensors="pt").input_ids]
    batched = generate(model, sampler, [others[0], ids, others[1]],
                       [SamplingParams(temperature=1.3), mine, SamplingParams(top_k=3, seed=7)], args.steps)
    print(f"    seed 42, run 1:           {tok.decode(run_a)!r}")
    print(f"    seed 42, run 2:           {tok.decode(run_b)!r}   identical: {run_a == run_b}")
    print(f"    seed 43:                  {tok.decode(run_c)!r}   identical to seed 42: {run_a == run_c}")
    print(f"    seed 42, row 2 of a batch: {tok.decode(batched[1])!r}   identical: {batched[1] == run_a}")
    print(f"      (its neighbours: {tok.decode(batched[0])!r} unseeded T=1.3, "
          f"{tok.decode(batched[2])!r} top_k=3 seed 7)")

    print(f"\nmachine: {machine()}")


if __name__ == "__main__":
    main()
