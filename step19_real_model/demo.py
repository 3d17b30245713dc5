"""`make demo`: real text from the embedded model through the newest engine, by this lesson's API.

    python -m step19_real_model.demo              # the embedded SmolLM2 (or --model FOLDER)

`LLM` builds lesson 17's engine at one rank, which adopts the parts of lesson 16's engine
with its CPU fast path where this CPU takes it: the engine every later lesson builds on.
"""
from __future__ import annotations

import time

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for a good night's sleep.",
    "Explain what a CPU does in two sentences.",
]


def main() -> None:
    args = base_parser(__doc__).parse_args()
    setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})")
    with LLM(folder, dtype=args.dtype, max_num_seqs=8) as llm:
        print(f"engine: {type(llm.engine).__name__}, decode steps "
              f"{getattr(llm.engine.runner, 'mode', 'eager')}\n")
        t0 = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                        SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
        secs = time.perf_counter() - t0
    for q, o in zip(QUESTIONS, outs):
        print(f"Q: {q}\nA: {o.outputs[0].text.strip()}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests batched together, {n} tokens in {secs:.1f} s ({n / secs:.1f} tok/s)")


if __name__ == "__main__":
    main()
