"""Lesson 07: the same tokens as lesson 05, at a flat cost per token."""
from __future__ import annotations

import torch

from minivllm_support.cli import base_parser
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step04_transformer.loader import load_model
from step05_naive.generate import generate_naive
from step06_sampler.params import SamplingParams
from step07_kv_cache.generate import generate_cached


def mean_ms(xs: list[float]) -> float:
    return 1e3 * sum(xs) / max(1, len(xs))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--tokens", type=int, default=120, help="tokens generated in each timing run (the naive loop is ~30 s a run here)")
    args = p.parse_args()
    dtype, folder, model, tok = start_lesson(args)
    eos = model.config.eos_token_ids

    ids = chat_prompt_ids(tok, "Give me three tips for learning to play the guitar.")
    out = generate_cached(model, ids, SamplingParams(temperature=0, max_tokens=64), eos)
    print(f"A: {tok.decode(out.token_ids, skip_special_tokens=True).strip()}\n")

    ids = chat_prompt_ids(tok, "Tell me a long story about a lighthouse keeper.")
    n = args.tokens
    # The answer above warmed up the cached loop; a few naive tokens warm up the rest. A full
    # untimed round would push the script towards two minutes, so the loops run twice each.
    generate_naive(model, ids, 8, ignore_eos=True)
    runs = compare({"naive": lambda: generate_naive(model, ids, n, ignore_eos=True),
                    "cached": lambda: generate_cached(model, ids, SamplingParams(temperature=0, max_tokens=n,
                                                                                 ignore_eos=True))},
                   repeats=args.repeats or 2, warmup=False)
    naive, cached = runs["naive"].result, runs["cached"].result
    agree = next((i for i, (a, b) in enumerate(zip(naive.token_ids, cached.token_ids)) if a != b), n)
    print(f"{n} greedy tokens after a {len(ids)}-token prompt, {args.dtype}: "
          f"the first {agree} of {n} equal lesson 05's")
    if agree < n:
        print("  (bf16 rounds a 1-row matmul and a whole-sequence matmul differently; once two logits "
              "are within that rounding, greedy picks can part. The fp32 check below is exact.)")
    print(f"  prefill (whole prompt, once): {1e3 * cached.step_seconds[0]:.1f} ms\n")
    print("  sequence length   naive ms/token   cached ms/token   (the last run of each)")
    bucket = max(1, n // 6)
    for s in range(0, n, bucket):
        a, b = naive.step_seconds[s:s + bucket], cached.step_seconds[max(1, s):s + bucket]
        print(f"  {len(ids) + s:>6}-{len(ids) + s + len(a) - 1:<6}     {mean_ms(a):10.1f}       {mean_ms(b):10.1f}")
    print(f"\n  total, the two loops taking turns: naive {runs['naive'].describe()}, "
          f"cached {runs['cached'].describe()}\n  -> cached {format_ratio(runs['naive'], runs['cached'])}")
    kv = model.config.kv_bytes_per_token * model.model.embed_tokens.weight.element_size() // 2
    print(f"  price: {kv / 1024:.1f} KiB of KV cache per token ({model.config.num_layers} layers x "
          f"{model.config.num_kv_heads} kv heads x {model.config.head_dim} dims x K,V), "
          f"{kv * (len(ids) + n) / 2**20:.1f} MiB for this request")

    exact = load_model(folder, torch.float32) if dtype != torch.float32 else model
    a = generate_naive(exact, ids, 48, ignore_eos=True).token_ids
    b = generate_cached(exact, ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)).token_ids
    print(f"\nfp32, 48 tokens: identical to lesson 05: {a == b}")
    if a != b:
        raise SystemExit("fp32 outputs differ from lesson 05")


if __name__ == "__main__":
    main()
