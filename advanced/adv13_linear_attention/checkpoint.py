"""Random Qwen3-Next checkpoints made with transformers, for the tests and run.py.

No Qwen3-Next weights small enough for these machines exist (the real one has 80B parameters),
so the lesson makes its own: transformers' `Qwen3NextForCausalLM` at a small shape, with random
weights from a fixed seed, written with `save_pretrained`. What it checks is exactness against
Hugging Face's implementation of the architecture, and what it measures is cost, both of which
random weights serve as well as trained ones; the tokens it generates mean nothing.
"""
from __future__ import annotations

from pathlib import Path

from minivllm_support.tiny import save_random_checkpoint

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=1024,
            bos_token_id=1, eos_token_id=2)


def build_hybrid_checkpoint(path: str | Path, seed: int = 0, **overrides) -> Path:
    """TINY (two DeltaNet layers, two attention layers) updated by `overrides`; dense MLPs
    (num_experts=0). Norm weights are randomised: their initial zeros would hide a wrong norm."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = {**TINY, "num_experts": 0, **overrides}
    # Qwen3-Next's norms add one to their weight (zeros at start), except the DeltaNet output norm.
    center = lambda name: 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
    return save_random_checkpoint(path, Qwen3NextConfig(**cfg), Qwen3NextForCausalLM, seed, center)
