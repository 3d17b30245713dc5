"""Shared fixtures: the tiny random Qwen3 and the embedded SmolLM2, each built/loaded once."""
from __future__ import annotations

import pytest
import torch

from minivllm_support.tiny import build_tiny_qwen3

torch.set_grad_enabled(False)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def smol_dir():
    return _embedded()  # always the embedded model: tests must not depend on what a user has cached


def _embedded():
    from minivllm_support.models import embedded_smollm2
    return embedded_smollm2()


@pytest.fixture(scope="session")
def smol_fp32(smol_dir):
    from step04_transformer.loader import load_model
    return load_model(smol_dir, torch.float32)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from minivllm_support.models import load_tokenizer
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="session")
def smol_hf(smol_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()


# Prompts used by every engine test: different lengths, chat and plain text.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Hi",
    "Explain in one sentence why the sky is blue, and then say goodbye politely.",
]


@pytest.fixture(scope="session")
def smol_prompts(smol_tokenizer):
    from minivllm_support.models import chat_prompt_ids
    return [chat_prompt_ids(smol_tokenizer, p) for p in PROMPTS]
