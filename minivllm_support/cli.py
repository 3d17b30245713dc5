"""Command-line flags every run.py shares."""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

from minivllm_support import cpu

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="checkpoint folder (default: $MINIVLLM_MODEL, "
                   "a cached Qwen3-0.6B, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="auto (default): bf16 where the CPU computes bf16 natively (AVX-512 BF16, AMX), "
                        "else fp32 (minivllm_support/cpu.py); or force bf16 / fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each variant, taking turns (default: the lesson's own; "
                        "`make figures` passes 1 in its short mode)")
    return p


def setup(args: argparse.Namespace) -> torch.dtype:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    args.dtype = resolve_dtype_name(args.dtype)    # what the prints then show: bf16 or fp32
    return DTYPES[args.dtype]


def resolve_dtype_name(name: str) -> str:
    """'auto' -> 'bf16' or 'fp32' by what this CPU computes natively; other names unchanged."""
    return DTYPE_NAMES[cpu.auto_dtype()] if name == "auto" else name


def machine() -> str:
    """One line naming the machine, its CPU class (figures hold for that class only), the dtype
    'auto' picks there, and the day; printed with every measurement."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    day = datetime.date.today().isoformat()
    return (f"{name} [{cpu.describe()}, auto dtype {resolve_dtype_name('auto')}], {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, {day}")


def identity_line(what: str, same: int, total: int, dtype: torch.dtype) -> str:
    """'identical outputs' as measured, with the reason when bf16 makes some of them differ."""
    line = f"identical {what}: {same}/{total}"
    if same < total and dtype != torch.float32:
        line += ("\n  (bf16: a matmul over a different batch shape rounds differently, and greedy decoding "
                 "follows the first near-tie that flips; run with --dtype fp32 for the exact comparison "
                 "the tests make)")
    return line
