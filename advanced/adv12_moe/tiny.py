"""A tiny random Qwen3-MoE checkpoint, built with transformers (the tests' and run.py's model).

Qwen3-MoE's real shapes (30B parameters, 128 experts of which 8 per token) do not fit these
machines; the code paths are the same at any size, so the tests hold this one to transformers."""
from __future__ import annotations

from pathlib import Path

from minivllm_support.tiny import save_random_checkpoint


def build_tiny_moe(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
               decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=512,
               rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return save_random_checkpoint(path, Qwen3MoeConfig(**cfg), Qwen3MoeForCausalLM, seed)
