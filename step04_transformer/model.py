"""The Qwen3 model (and, through two switches, Qwen2 and Llama).

The model works on a flat list of tokens: input_ids [T] and positions [T]. It never decides
which token may see which: that is the job of the *step attention* it is handed, a
callable `attn(layer_idx, q, k, v) -> out` with q [T, Hq, D], k/v [T, Hkv, D], out [T, Hq, D].
(Lesson 15's *attention backend* is something else: which kernel such a callable runs.)
This lesson's step attention treats the T tokens as one causal sequence. Later lessons keep
this exact model and swap the step attention: a KV cache (07), padded batches (08), many sequences
(09-11), a paged KV pool (12-13), one varlen kernel (14-15).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from step03_attention.attention import attention
from step04_transformer.config import ModelConfig
from step04_transformer.layers import RMSNorm, RotaryEmbedding, SwiGLU, rope_qk


class StepAttention(Protocol):
    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class SingleSequenceAttention:
    """All T tokens form one sequence starting at position 0: plain causal attention."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # [T, H, D] -> [1, H, T, D] for the step03 function, and back.
        out = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return out[0].transpose(0, 1)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: normalise each head's q and k before RoPE (keeps logits tame)
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[T, hidden] -> q [T, nh, hd], k and v [T, nkv, hd]: three matmuls (lesson 16 makes them one)."""
        T = x.shape[0]
        return (self.q_proj(x).view(T, self.nh, self.hd), self.k_proj(x).view(T, self.nkv, self.hd),
                self.v_proj(x).view(T, self.nkv, self.hd))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: StepAttention) -> Tensor:
        T = x.shape[0]
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_qk(q, k, cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(T, self.nh * self.hd))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)): pre-norm residual blocks."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: StepAttention) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names mirror the Hugging Face checkpoints, so the loader needs no renaming."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        # Tied models (Qwen3-0.6B, SmolLM2) reuse the embedding matrix as the LM head.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor,
                attn: StepAttention | None = None) -> Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        attn = attn or SingleSequenceAttention()
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 logits [N, vocab]. Call it only on rows you will sample from."""
        if self.lm_head is None:                      # tied: the embedding matrix is the head
            return (hidden @ self.model.embed_tokens.weight.t()).float()
        return self.lm_head(hidden).float()           # a module: later lessons swap in packed linears
