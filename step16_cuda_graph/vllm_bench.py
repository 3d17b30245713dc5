"""vLLM's CPU build on the workloads of our benchmark scripts, for a side-by-side comparison.

Runs inside its own venv (`make compare-vllm` builds `.venv-vllm` and runs this file); our
bench.py calls it as a subprocess between its own runs. Same checkpoint (the random-weight
Qwen3-0.6B shape), same token-id prompts, same greedy outputs of fixed length:

    python step16_cuda_graph/vllm_bench.py --what workload   # lesson 14's bench workload
    python step16_cuda_graph/vllm_bench.py --what batch1     # one 128-token prompt, 65 tokens out
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

# vLLM's CPU backend reads these when it starts: pin its OpenMP threads to our two cores, and
# give its KV cache 4 GiB (it would otherwise take a default share of the machine's memory).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def make_llm(path: str):
    from vllm import LLM
    # Token-id prompts need no tokenizer; the budget and batch size are those of our engines
    # (chunked prefill at 512 tokens a step, 64 sequences); 4k positions are plenty here.
    return LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=64,
               max_num_batched_tokens=512, enable_chunked_prefill=True, max_model_len=4096,
               enable_prefix_caching=True)


def generate(llm, prompts: list[list[int]], outs: list[int]) -> float:
    from vllm import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
              for n in outs]
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    got = [len(r.outputs[0].token_ids) for r in results]
    if got != list(outs):
        raise RuntimeError(f"vLLM returned other output lengths than asked: {got[:8]} ...")
    return secs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["workload", "batch1", "all"], default="all")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="4 short requests: a smoke test")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = p.parse_args()

    import vllm
    from minivllm_support.cli import machine
    from step14_batched_forward.bench import QWEN3_06B_SHAPE, random_qwen3_06b, workload

    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    llm = make_llm(str(random_qwen3_06b()))
    result: dict = {"vllm_version": vllm.__version__}
    generate(llm, [[1000 + i for i in range(64)]], [8])                 # warm-up, not timed
    if args.what in ("workload", "all"):
        prompts, outs = workload(4 if args.quick else 64, args.seed, QWEN3_06B_SHAPE["vocab_size"])
        if args.quick:
            outs = [8] * len(outs)
        secs = generate(llm, prompts, outs)
        result.update(workload_secs=secs, workload_tok_s=sum(outs) / secs, output_tokens=sum(outs))
        print(f"workload: {len(prompts)} requests, outputs sum {sum(outs)}: vLLM-CPU {vllm.__version__} "
              f"{secs:.1f} s, {sum(outs) / secs:.1f} output tok/s")
    if args.what in ("batch1", "all"):
        rng = random.Random(args.seed)
        prompt = [rng.randrange(1000, 150000) for _ in range(128)]
        # Decode speed without the prefill: 65 tokens minus 1 token, both from the same prompt
        # (the second run's prompt is a prefix-cache hit in both; vLLM caches it after the first).
        n = 9 if args.quick else 65
        generate(llm, [prompt], [1])
        one, many = generate(llm, [prompt], [1]), generate(llm, [prompt], [n])
        result["batch1_tok_s"] = (n - 1) / (many - one)
        print(f"batch 1, 128-token prompt: vLLM-CPU {vllm.__version__} {result['batch1_tok_s']:.1f} decode tok/s "
              f"({n} tokens minus 1 token)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
