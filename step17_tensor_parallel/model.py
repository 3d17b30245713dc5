"""Lesson 04's model, with each layer's linears, the embedding and the LM head swapped for
their parallel versions. The forward pass is lesson 04's, line for line: the two all-reduces
per layer live inside o_proj and down_proj (RowParallelLinear).

One decoder layer on 2 ranks (Qwen3-0.6B: 16 query heads, 8 KV heads, MLP 3072):

              rank 0                                     rank 1
    x [T, 1024] (same on both) ------------------------- x [T, 1024]
    q/k/v: heads 0-7, KV heads 0-3                       heads 8-15, KV heads 4-7
    attention over its own KV pool slice                 attention over its own KV pool slice
    o_proj rows 0..1023 of W_o^T -> partial [T, 1024]    rows 1024..2047 -> partial [T, 1024]
                         \\____________ all-reduce (sum) ____________/
    h = x + attn  (same on both)                         h = x + attn
    gate/up: MLP columns 0..1535                         columns 1536..3071
    down_proj -> partial [T, 1024]                       partial [T, 1024]
                         \\____________ all-reduce (sum) ____________/
    out = h + mlp (same on both)                         out = h + mlp

Each rank's `config` is its local one (its heads, KV heads and MLP width): the KV pool, the
attention views and lesson 16's buffers size themselves from it with no other change.
"""
from __future__ import annotations

import dataclasses

from step04_transformer.config import ModelConfig
from step04_transformer.model import CausalLM
from step17_tensor_parallel.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding)


def check_tp_shapes(cfg: ModelConfig, tp: int) -> None:
    """Refuse, before any process starts, a model that cannot be split `tp` ways."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    checks = [("num_attention_heads", cfg.num_heads, cfg.num_heads % tp == 0),
              ("intermediate_size", cfg.intermediate_size, cfg.intermediate_size % tp == 0)]
    if cfg.num_kv_heads >= tp:
        checks.append(("num_key_value_heads", cfg.num_kv_heads, cfg.num_kv_heads % tp == 0))
    else:   # fewer KV heads than ranks: each is replicated on tp / num_kv_heads ranks
        checks.append(("num_key_value_heads", cfg.num_kv_heads, tp % cfg.num_kv_heads == 0))
    for name, value, ok in checks:
        if not ok:
            hint = (f"tensor_parallel_size={tp} must be a multiple of it" if name == "num_key_value_heads"
                    and value < tp else f"it is not divisible by tensor_parallel_size={tp}")
            raise ValueError(f"cannot split the model {tp} ways: {name}={value}: {hint}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one rank holds: its query heads, its (possibly replicated) KV heads, its MLP width."""
    check_tp_shapes(cfg, tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
                               intermediate_size=cfg.intermediate_size // tp)


class TPCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, rank: int, world: int):
        super().__init__(local_config(cfg, world))          # lesson 04's modules at the local sizes ...
        self.full_config, self.rank, self.world = cfg, rank, world
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        kv_shards = min(cfg.num_kv_heads, world)
        for layer in self.model.layers:                      # ... then the parallel ones swapped in
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear(H, cfg.num_heads * D, bias, rank, world)
            attn.k_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, bias, rank, world, kv_shards)
            attn.v_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, bias, rank, world, kv_shards)
            attn.o_proj = RowParallelLinear(cfg.num_heads * D, H, False, rank, world)
            mlp.gate_proj = ColumnParallelLinear(H, cfg.intermediate_size, False, rank, world)
            mlp.up_proj = ColumnParallelLinear(H, cfg.intermediate_size, False, rank, world)
            mlp.down_proj = RowParallelLinear(cfg.intermediate_size, H, False, rank, world)
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, rank, world)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, tied=cfg.tie_word_embeddings)

    def compute_logits(self, hidden):
        """float32 [N, vocab] on rank 0; None on the other ranks (they only send their part)."""
        return self.lm_head(hidden)
