"""The opening every engine lesson's run.py shares: flags -> machine line -> model and tokenizer.

It lives here because it loads the model with this lesson's loader; later lessons import it."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from minivllm_support.cli import machine, setup
from minivllm_support.models import load_tokenizer, resolve_model
from step04_transformer.loader import load_model


def start_lesson(args: argparse.Namespace) -> tuple[torch.dtype, Path, torch.nn.Module, object]:
    """Apply --threads/--dtype, find the model, print where we run, load model and tokenizer."""
    dtype = setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    return dtype, folder, load_model(folder, dtype), load_tokenizer(folder)
