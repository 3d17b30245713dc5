"""Lesson 05: real text from the naive loop, and the time per token growing with length."""
from __future__ import annotations

import time

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import chat_prompt_ids, load_tokenizer, resolve_model
from step04_transformer.loader import load_model
from step05_naive.generate import generate_naive


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=240, help="tokens for the timing run")
    args = p.parse_args()
    dtype = setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    t0 = time.perf_counter()
    model = load_model(folder, dtype)
    tok = load_tokenizer(folder)
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {model.config.architecture}, "
          f"{model.config.num_layers} layers, hidden {model.config.hidden_size}\n")

    for question in ["What is the capital of France?", "Write a haiku about the sea."]:
        ids = chat_prompt_ids(tok, question)
        out = generate_naive(model, ids, args.max_new_tokens, model.config.eos_token_ids)
        secs = sum(out.step_seconds)
        print(f"Q: {question}\nA: {tok.decode(out.token_ids, skip_special_tokens=True).strip()}")
        print(f"   ({len(out.token_ids)} tokens in {secs:.2f} s, {len(out.token_ids) / secs:.1f} tok/s, "
              f"stopped by {'EOS' if out.finished_by_eos else 'max_new_tokens'})\n")

    # Timing: ignore EOS so the sequence really grows, then bucket the per-step times.
    ids = chat_prompt_ids(tok, "Tell me a long story about a lighthouse keeper.")
    out = generate_naive(model, ids, args.long_tokens, ignore_eos=True)
    print(f"time per token vs sequence length ({len(ids)}-token prompt, {args.long_tokens} steps):")
    bucket = max(1, args.long_tokens // 6)
    for start in range(0, len(out.step_seconds), bucket):
        chunk = out.step_seconds[start:start + bucket]
        L = len(ids) + start
        print(f"  length {L:>4}-{L + len(chunk) - 1:<4}: {1e3 * sum(chunk) / len(chunk):7.1f} ms/token")
    first, last = out.step_seconds[:bucket], out.step_seconds[-bucket:]
    print(f"last bucket / first bucket: {(sum(last) / len(last)) / (sum(first) / len(first)):.2f}x "
          f"-- every step re-reads the whole sequence")


if __name__ == "__main__":
    main()
