"""Advanced 01's Q4_1 weights at batch 1 beside llama.cpp on the same file (`make compare-llamacpp`
runs it after lesson 18's bf16 rows).

    python advanced/adv01_quantization/vs_llamacpp.py --runs 5

The embedded SmolLM2 ships as a Q4_1 GGUF file: llama.cpp reads it as it is; ours is lesson 16's
fast-path engine on the file's own Q4_1 blocks (`q4_1_engine`: Q41Linear, our C kernel, every
layer of a small step in one C call); `--ours eager` runs lesson 19's LLM (eager) with
torch's int4 kernel on the same blocks instead (`q4_1_llm`). The measurement
is lesson 18's (`step18_benchmark.llamacpp_bench.compare`): a 128-token prompt, then greedy
tokens one at a time, the two sides taking turns.
"""
from __future__ import annotations

import sys

import torch

from advanced.adv01_quantization.engine import q4_1_llm
from advanced.adv01_quantization.gguf_q4_1 import embedded_gguf
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step18_benchmark.llamacpp_bench import Ours, arguments, compare


def ours_engine(kind: str, dtype: torch.dtype | None = None) -> Ours:
    if kind == "eager":
        llm, report = q4_1_llm(dtype="bf16", max_num_seqs=4, kv_cache_bytes=256 * 2**20)
        return Ours(llm.engine, f"advanced 01: Int4Linear on the file's Q4_1 blocks ({report.swapped} linears, eager)")
    from advanced.adv01_quantization.q4_1_kernel import Q41Linear, load, q4_1_engine
    if load() is None:
        sys.exit("the Q4_1 kernel could not be built here: run with --ours eager")
    engine = q4_1_engine(PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20),
                         dtype)
    n = sum(type(m) is Q41Linear for m in engine.model.modules())
    how = "every layer in one C call" if getattr(engine.runner, "one_call_steps", None) else "compiled layers"
    act = str(engine.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    return Ours(engine, f"advanced 01: Q41Linear on the file's Q4_1 blocks ({n} linears, q|k|v and gate|up stacked), "
                        f"{act} activations, lesson 16's fast path, steps of <= 4 rows: {how}")


def main() -> None:
    ours_kind = "eager" if "--ours" in sys.argv and sys.argv[sys.argv.index("--ours") + 1] == "eager" else "fast"
    if "--ours" in sys.argv:
        i = sys.argv.index("--ours")
        del sys.argv[i:i + 2]
    args = arguments(__doc__, ("smollm2-q4_1",))
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    compare("smollm2-q4_1", ours_engine(ours_kind, dtype), embedded_gguf(), args.runs, args.tokens, args.threads,
            args.seed)


if __name__ == "__main__":
    main()
