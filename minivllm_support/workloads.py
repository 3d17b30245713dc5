"""What the benchmark scripts share: the Qwen3-0.6B-shaped random checkpoint, the bench
workload, timing steps, the memory floor.

Measurement code, not a lesson: every lesson's bench.py and run.py may import it, and it
imports no lesson (filling an engine with sequences needs the engine's types: lesson 16's
decode_timing.py does that).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from minivllm_support.models import cache_dir


QWEN3_06B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)


def random_qwen3_06b() -> Path:
    """A random-weight checkpoint of the Qwen3-0.6B shape, written once into our cache (bf16)."""
    path = cache_dir() / "qwen3-0.6b-shape-random"
    if not (path / "config.json").is_file():
        from transformers import Qwen3Config, Qwen3ForCausalLM
        print(f"[bench] writing a random Qwen3-0.6B-shaped checkpoint to {path} (once)")
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B_SHAPE)).to(torch.bfloat16).save_pretrained(str(path))
    return path


def workload(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    outs = [rng.randint(64, 256) for _ in range(n)]
    return prompts, outs


def time_steps(engine, steps: int) -> float:
    """Milliseconds per step over the next `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def read_bandwidth() -> float:
    """Bytes a second this machine reads: a float32 sum over 2 GiB (bound by memory, not math)."""
    big = torch.ones(2**29, dtype=torch.float32)
    big.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        big.sum()
    return 3 * big.numel() * 4 / (time.perf_counter() - t0)


def weight_floor(model) -> tuple[float, float, float]:
    """Bytes one decode step must read (every weight once; the embedding only as the LM head),
    the machine's read bandwidth (read_bandwidth), and their ratio."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = read_bandwidth()
    return nbytes, bandwidth, bandwidth / nbytes
