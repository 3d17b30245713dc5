"""Attention written out by hand, so every later kernel has a reference to be equal to.

Shapes follow PyTorch's convention: [batch, heads, seq, head_dim].
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def causal_mask(q_len: int, kv_len: int, device=None) -> Tensor:
    """Boolean [q_len, kv_len]; True where a query may look.

    The queries are the *last* q_len positions of a kv_len-long sequence, so query i sits at
    absolute position kv_len - q_len + i and may see keys 0..that position. With q_len == kv_len
    this is the usual lower triangle; with q_len == 1 (decoding) it is all True.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return k_pos <= q_pos


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """GQA: each of the Hkv key/value heads serves n_rep query heads. [B,Hkv,L,D] -> [B,Hkv*n_rep,L,D]."""
    if n_rep == 1:
        return x
    b, h, L, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, L, d).reshape(b, h * n_rep, L, d)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
              mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale + mask) v, with grouped-query heads.

    q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] with Hq a multiple of Hkv.
    mask: optional boolean, broadcastable to [B, Hq, Lq, Lk], True = may attend.
    The softmax runs in float32 whatever the input dtype, as fused kernels do.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    k, v = repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    allowed = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v.float()).to(q.dtype)


# ---- RoPE -------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """Frequencies theta^(-2i/d) for i in [0, d/2): low dims spin fast, high dims slowly."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin tables [..., head_dim] for the given integer positions, in float32."""
    angles = positions.float()[..., None] * inv_freq  # [..., D/2]
    angles = torch.cat([angles, angles], dim=-1)       # the half-split layout HF checkpoints use
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (x[i], x[i + D/2]) pair by its position's angle.

    cos/sin must broadcast against x (e.g. x [T, H, D] with cos [T, 1, D]). They are cast to x's
    dtype first, exactly as Hugging Face does, so bf16 results match theirs bit for bit.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
