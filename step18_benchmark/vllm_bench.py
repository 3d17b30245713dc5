"""vLLM's CPU build on the workloads of our benchmark scripts, for a side-by-side comparison.

Runs inside its own venv (`make compare-vllm` builds `.venv-vllm` and runs this file); our
bench.py calls it as a subprocess between its own runs. Same checkpoint (the random-weight
Qwen3-0.6B shape), same token-id prompts, same greedy outputs of fixed length:

    python step18_benchmark/vllm_bench.py --what workload   # lesson 14's bench workload
    python step18_benchmark/vllm_bench.py --what batch1     # one 128-token prompt, 128 tokens out
    python step18_benchmark/vllm_bench.py --what linears    # its oneDNN binding: call cost, projections
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

# vLLM's CPU backend reads these when it starts: pin its OpenMP threads to our two cores, and
# give its KV cache 6 GiB, what our engine gets in steady.py (whole GiB only; without it vLLM
# takes a default share of the memory). In float32 (baseline mode) a token's K/V take 224 KB:
# 4 GiB hold 18.7k tokens, fewer than the workload's 64 sequences reach together (23.7k), so
# vLLM would preempt and recompute where our engine does not.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")

# The workloads and timing loops our bench.py runs too; they live with lesson 16's fast path,
# the first lesson to measure against vLLM-CPU.
from step16_cuda_graph.cpu.measure import FUSED_PROJECTIONS, call_us, phase_workloads, projection_ms  # noqa: E402


def vllm_linears() -> dict:
    """vLLM's own oneDNN binding (`_C.onednn_mm`, the handler its CPU linears hold): the fixed
    cost of a call, and 28 layers of the fused projections at decode and prompt row counts."""
    import torch
    from vllm import _custom_ops as ops
    torch.set_grad_enabled(False)
    w = (torch.randn(64, 64) * 0.02).bfloat16()
    tiny, x, out = ops.create_onednn_mm(w.t(), 32), torch.randn(8, 64).bfloat16(), torch.empty(8, 64).bfloat16()
    result = {"fixed_us": call_us(lambda: torch.ops._C.onednn_mm(out, x, None, tiny.handler_tensor))}
    handlers = [ops.create_onednn_mm((torch.randn(n, k) * 0.02).bfloat16().t(), 32)
                for _ in range(28) for n, k in FUSED_PROJECTIONS]
    result["projections_ms"] = {rows: projection_ms(handlers, FUSED_PROJECTIONS, lambda h, x: ops.onednn_mm(h, x, None),
                                                    rows) for rows in (8, 64, 512)}
    return result


def make_llm(path: str, dtype: str = "bfloat16"):
    from vllm import LLM
    # Token-id prompts need no tokenizer. The budget and batch size are those of our engines:
    # chunked prefill at 512 tokens a step, 64 sequences (vLLM's CPU defaults for the LLM class
    # are 4096 tokens a step and 256 sequences, chunked prefill and prefix caching on).
    # disable_log_stats=False: each RequestOutput then carries its token timestamps (metrics).
    return LLM(model=path, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=64,
               max_num_batched_tokens=512, enable_chunked_prefill=True, max_model_len=4096,
               enable_prefix_caching=True, disable_log_stats=False)


def generate(llm, prompts: list[list[int]], outs: list[int]) -> tuple[float, list]:
    """Wall seconds of one generate call, and vLLM's RequestOutputs."""
    from vllm import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
              for n in outs]
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    got = [len(r.outputs[0].token_ids) for r in results]
    if got != list(outs):
        raise RuntimeError(f"vLLM returned other output lengths than asked: {got[:8]} ...")
    return secs, results


def decode_tok_s(llm, prompt: list[int], n: int) -> tuple[float, str]:
    """Batch-1 decode speed without the prefill: from vLLM's own first/last token timestamps
    when it reports them, else the time of n tokens minus the time of 1 token (two runs)."""
    secs, (out,) = generate(llm, [prompt], [n])
    m = out.metrics
    if m is not None and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0) > 0:
        return (n - 1) / (m.last_token_ts - m.first_token_ts), "first to last token, vLLM's timestamps"
    one, _ = generate(llm, [prompt], [1])
    return (n - 1) / (secs - one), f"{n} tokens minus 1 token, two runs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["workload", "batch1", "phases", "linears", "all"], default="all")
    p.add_argument("--rounds", type=int, default=1, help="repeat each measurement; the best is kept")
    p.add_argument("--seed", type=int, default=1, help="the workload's seed (step15/16 bench.py: 1)")
    p.add_argument("--quick", action="store_true", help="4 short requests: a smoke test")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--requests", type=int, default=64, help="workload: how many of its requests")
    args = p.parse_args()

    if os.environ.get("MINIVLLM_BASELINE", "0") not in ("", "0"):
        # Baseline mode (minivllm_support/cpu.py): torch's libraries are capped at AVX2 by the
        # environment; vLLM picks its own kernel build (_C_AVX2, _C_AVX512 or _C) by asking torch
        # what the CPU has, so it is told what an AVX2-only CPU would tell it.
        import torch
        from minivllm_support.cpu import TORCH_BASELINE_ENV
        os.environ.update(TORCH_BASELINE_ENV)
        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
    import vllm
    from minivllm_support.workloads import QWEN3_06B_SHAPE, random_qwen3_06b, workload
    try:
        from minivllm_support.cli import machine
        print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    except ImportError as e:               # it needs only torch, but say so rather than fail
        print(f"machine: ? ({e})")
    if args.what == "linears":                 # no engine needed
        result = vllm_linears()
        print(f"vLLM-CPU {vllm.__version__} onednn_mm: {result['fixed_us']:.1f} us a tiny call; 28 layers of "
              f"fused projections: " + ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in result["projections_ms"].items()))
        if args.json:
            print(json.dumps(result))
        return

    llm = make_llm(str(random_qwen3_06b()), args.dtype)     # startup (load, compile, KV cache) is not timed
    name = f"vLLM-CPU {vllm.__version__}"
    result: dict = {"vllm_version": vllm.__version__}
    generate(llm, [[1000 + i for i in range(64)]], [8])                 # warm-up, not timed
    if args.what in ("workload", "all"):
        prompts, outs = workload(4 if args.quick else args.requests, args.seed, QWEN3_06B_SHAPE["vocab_size"])
        if args.quick:
            outs = [8] * len(outs)
        print(f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
              f"tokens, outputs {min(outs)}-{max(outs)} (sum {sum(outs)}), ignore_eos, greedy; "
              f"max_num_seqs=64, max_num_batched_tokens=512", flush=True)
        # Each round is a new set of requests with the same prompts; vLLM's prefix cache may keep
        # some of their blocks from the round before (ours starts each round with a new engine).
        best = float("inf")
        for r in range(args.rounds):
            secs, _ = generate(llm, prompts, outs)
            best = min(best, secs)
            print(f"round {r + 1}, {name}: {secs:6.1f} s, {sum(outs) / secs:6.1f} output tok/s", flush=True)
        result.update(workload_secs=best, workload_tok_s=sum(outs) / best, output_tokens=sum(outs))
    if args.what == "phases":
        # Each phase on prompts vLLM has not seen: the prefix cache must not serve the second.
        for i, (phase, (prompts, outs)) in enumerate(phase_workloads(args.seed + 100).items()):
            secs, _ = generate(llm, prompts, outs)
            result[phase] = secs
            print(f"{phase}, {name}: {secs:6.1f} s", flush=True)
    if args.what in ("batch1", "all"):
        rng = random.Random(args.seed)
        prompt = [rng.randrange(1000, 150000) for _ in range(128)]
        n = 16 if args.quick else 128
        # Best of 3 at least, as our bench takes the best turn: this machine's speed drifts.
        runs = [decode_tok_s(llm, prompt, n) for _ in range(max(3, args.rounds))]
        tok_s, how = max(runs)
        result["batch1_tok_s"] = tok_s
        print(f"batch 1, 128-token prompt, {n} tokens out: {name} {tok_s:.1f} decode tok/s (best of "
              f"{len(runs)}: {', '.join(f'{t:.1f}' for t, _ in runs)}; {how})", flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
