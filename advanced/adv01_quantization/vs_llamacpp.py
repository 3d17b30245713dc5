"""Advanced 01's Q4_1 weights at batch 1 beside llama.cpp on the same file (`make compare-llamacpp`
runs it after lesson 18's bf16 rows).

    python advanced/adv01_quantization/vs_llamacpp.py --runs 5

The embedded SmolLM2 ships as a Q4_1 GGUF file: llama.cpp reads it as it is; ours is lesson 19's
LLM (eager) with Int4Linear built from the file's own Q4_1 blocks (`q4_1_llm`). The measurement
is lesson 18's (`step18_benchmark.llamacpp_bench.compare`): a 128-token prompt, then greedy
tokens one at a time, the two sides taking turns.
"""
from __future__ import annotations

from advanced.adv01_quantization.engine import q4_1_llm
from advanced.adv01_quantization.gguf_q4_1 import embedded_gguf
from step18_benchmark.llamacpp_bench import Ours, arguments, compare


def main() -> None:
    args = arguments(__doc__, ("smollm2-q4_1",))
    llm, report = q4_1_llm(dtype="bf16", max_num_seqs=4, kv_cache_bytes=256 * 2**20)
    ours = Ours(llm.engine, f"advanced 01: Int4Linear on the file's Q4_1 blocks ({report.swapped} linears, eager)")
    compare("smollm2-q4_1", ours, embedded_gguf(), args.runs, args.tokens, args.threads, args.seed)


if __name__ == "__main__":
    main()
