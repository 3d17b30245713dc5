"""A tiny random Qwen3 checkpoint, built with transformers, for fast exact tests."""
from __future__ import annotations

from pathlib import Path


def build_tiny_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    # HF initialises norms to ones; randomise them so q/k-norm and RMSNorm weights are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return Path(path)
