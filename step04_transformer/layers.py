"""The building blocks of a Qwen3 decoder layer. Every module works on flattened tokens [T, ...]."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from step03_attention.attention import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Computed in float32 and cast back, as the checkpoints were trained."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a gated MLP; the gate decides how much of `up` passes."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def project_gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Two matmuls of the same input (lesson 16 makes them one)."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.project_gate_up(x)
        return self.down_proj(nn.functional.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, looked up by each token's absolute position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        cos, sin = rope_cos_sin(torch.arange(max_positions), rope_inv_freq(head_dim, theta))
        self.register_buffer("cos", cos, persistent=False)  # float32 [P, D]
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round the tables too (every angle off by up to 2^-9) and
        # hand kernels that read float32 tables bf16 ones: they follow the device, never the dtype.
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        if self.cos.dtype != cos.dtype and not cos.is_meta:
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"negative position {int(positions.min())}")
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} exceeds the model's "
                             f"max_position_embeddings ({self.cos.shape[0]})")
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, D]


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
