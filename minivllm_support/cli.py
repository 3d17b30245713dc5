"""Command-line flags every run.py shares."""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="checkpoint folder (default: $MINIVLLM_MODEL, "
                   "a cached Qwen3-0.6B, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="bf16 (default: oneDNN bf16 kernels beat fp32 on this CPU) or fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    return p


def setup(args: argparse.Namespace) -> torch.dtype:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    return DTYPES[args.dtype]


def machine() -> str:
    """One line naming the machine and the day, printed with every measurement."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    day = datetime.date.today().isoformat()
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, {day}")


def identity_line(what: str, same: int, total: int, dtype: torch.dtype) -> str:
    """'identical outputs' as measured, with the reason when bf16 makes some of them differ."""
    line = f"identical {what}: {same}/{total}"
    if same < total and dtype != torch.float32:
        line += ("\n  (bf16: a matmul over a different batch shape rounds differently, and greedy decoding "
                 "follows the first near-tie that flips; run with --dtype fp32 for the exact comparison "
                 "the tests make)")
    return line
