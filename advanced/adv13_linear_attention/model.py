"""A Qwen3-Next hybrid: gated DeltaNet layers mixed with gated full-attention layers.

    layer_types  [lin, lin, lin, full, lin, lin, lin, full, ...]    (full_attention_interval = 4)
    every layer  x + mixer(norm(x)), then h + mlp(norm(h))           (lesson 04's block)
    full         lesson 04's attention with an output gate and RoPE on part of each head; its
                 K/V go to the paged pool through the step attention, as in lessons 12-15
    lin          projections -> short conv -> gated delta rule -> gated norm -> out_proj; its
                 memory is a fixed-size state per sequence (state_pool.py)

Like lesson 04's model it runs a flat list of tokens and never decides which token belongs to
which sequence: the `step` it is handed knows (the engine's step, or one sequence from 0).
Parameter names are the checkpoint's, so lesson 04's strict loader fills the model unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from step03_attention.attention import apply_rope
from step04_transformer.layers import RotaryEmbedding, SwiGLU
from step04_transformer.loader import load_weights
from step04_transformer.model import CausalLM
from advanced.adv13_linear_attention.config import FULL, HybridConfig
from advanced.adv13_linear_attention.state_pool import HybridStep, single_sequence_step


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: the weight is stored as an offset from 1 (x / rms(x) * (1 + w))."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """norm(x) * w * silu(z): the delta rule's output, normalised per head and gated by z."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig, kv_index: int):
        super().__init__()
        self.kv_index = kv_index            # this layer's place in the KV pool (attention layers only)
        self.nh, self.nkv, self.hd, self.rd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.nh * self.hd, bias=False)   # query | gate, per head
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.hd, cfg.rms_norm_eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return torch.cat([apply_rope(x[..., :self.rd], cos, sin), x[..., self.rd:]], dim=-1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: HybridStep) -> Tensor:
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.nh, 2 * self.hd).split(self.hd, dim=-1)
        q = self.rope(self.q_norm(q), cos, sin)
        k = self.rope(self.k_norm(self.k_proj(x).view(T, self.nkv, self.hd)), cos, sin)
        out = step(self.kv_index, q, k, self.v_proj(x).view(T, self.nkv, self.hd))
        return self.o_proj(out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1)))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig, state_index: int):
        super().__init__()
        self.state_index = state_index      # this layer's place in the state pool (linear layers only)
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        per_key_head = 2 * self.dk + 2 * self.dv * self.hv // self.hk          # q, k, then v and z of its value heads
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, self.hk * per_key_head, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.hv, bias=False)  # write strength, forget gate
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, groups=cfg.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The checkpoint groups its projections by key head ([q k v z] of key head 0, then 1, ...).
        Returns q|k|v as the conv's channels [T, 2 Hk dk + Hv dv], z [T, Hv, dv], b and a [T, Hv]."""
        T, r = x.shape[0], self.hv // self.hk
        q, k, v, z = self.in_proj_qkvz(x).view(T, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(x).view(T, self.hk, 2 * r).split([r, r], -1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, self.hv, self.dv), b.reshape(T, self.hv), a.reshape(T, self.hv)

    def forward(self, x: Tensor, step: HybridStep) -> Tensor:
        T = x.shape[0]
        qkv, z, b, a = self.project(x)
        qkv = step.conv(self.state_index, qkv, self.conv1d.weight[:, 0, :])
        q, k, v = qkv.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        beta = b.sigmoid()                                                  # how much of the error to write
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log of the forget factor, <= 0
        out = step.delta(self.state_index, q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk),
                         v.view(T, self.hv, self.dv), g, beta)
        return self.out_proj(self.norm(out, z).reshape(T, -1))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_idx: int):
        super().__init__()
        kind = cfg.layer_types[layer_idx]
        if kind == FULL:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer_idx))
        else:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer_idx))
        self.is_attention = kind == FULL
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: HybridStep) -> Tensor:
        h = self.input_layernorm(x)
        h = self.self_attn(h, cos, sin, step) if self.is_attention else self.linear_attn(h, step)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridBackbone(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridLM(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.config = cfg
        self.model = HybridBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, step: HybridStep | None = None) -> Tensor:
        """input_ids, positions [T] -> hidden [T, hidden]. No step: one sequence from position 0."""
        step = step or single_sequence_step(self.config, input_ids.shape[0], self.model.embed_tokens.weight)
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, step)
        return self.model.norm(x)

    compute_logits = CausalLM.compute_logits     # lesson 04's head, tied or not


def load_hybrid(folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> HybridLM:
    """config.json -> empty model -> lesson 04's strict loader (names every missing or unexpected tensor)."""
    cfg = HybridConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = HybridLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings)
    load_weights(model, folder, dtype)
    return model.eval().requires_grad_(False)
