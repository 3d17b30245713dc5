"""A tiny random Qwen3 checkpoint, built with transformers, for fast exact tests."""
from __future__ import annotations

from pathlib import Path
from typing import Callable


def build_tiny_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    return save_random_checkpoint(path, Qwen3Config(**cfg), Qwen3ForCausalLM, seed)


def save_random_checkpoint(path: Path, config, model_class, seed: int = 0,
                           norm_center: Callable[[str], float] = lambda name: 1.0) -> Path:
    """transformers' `model_class(config)` with its weights drawn from `seed`, saved with
    save_pretrained. Norm weights start at a constant (ones, or zeros where a model adds one
    itself); drawn around `norm_center(name)` instead, a wrong norm cannot hide."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center(name) + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return Path(path)
