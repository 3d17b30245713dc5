"""`make demo`: real text from the embedded model through the newest engine of the tutorial."""
from __future__ import annotations

import time

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import chat_prompt_ids, load_tokenizer, resolve_model
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu import engine as newest

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for a good night's sleep.",
    "Explain what a CPU does in two sentences.",
]


def main() -> None:
    args = base_parser(__doc__).parse_args()
    dtype = setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype}), engine: {newest.__name__}.build_engine\n")
    model, tok = load_model(folder, dtype), load_tokenizer(folder)
    engine = newest.build_engine(model, PagedSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                             kv_cache_bytes=256 * 2**20))
    t0 = time.perf_counter()
    seqs = engine.generate([chat_prompt_ids(tok, q) for q in QUESTIONS],
                           SamplingParams(temperature=0, max_tokens=96))
    secs = time.perf_counter() - t0
    for q, s in zip(QUESTIONS, seqs):
        print(f"Q: {q}\nA: {tok.decode(s.output_token_ids, skip_special_tokens=True).strip()}\n")
    n = sum(len(s.output_token_ids) for s in seqs)
    print(f"{len(seqs)} requests batched together, {n} tokens in {secs:.1f} s ({n / secs:.1f} tok/s)")


if __name__ == "__main__":
    main()
