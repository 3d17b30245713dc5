"""One matmul where the model reads the same input two or three times: q/k/v, and gate/up.

Every layer projects its normalised input three times (q, k, v) and, in the MLP, twice (gate,
up). Stacking those weights row-wise gives one larger matrix whose output holds the small
outputs side by side; slicing it costs nothing (views):

    x [T, 1024] @ [q 2048 | k 1024 | v 1024]^T  ->  [T, 4096] = q | k | v
    x [T, 1024] @ [gate 3072 | up 3072]^T       ->  [T, 6144] = gate | up

Each output column is still the dot product of x with one weight row, so the numbers are the
same as before (checked bit for bit in the tests). What changes is the number of calls: 4
linears a layer instead of 7, 112 oneDNN calls a step instead of 196 on Qwen3-0.6B. In a decode
step each call has a fixed cost (dispatch, splitting the work across the cores, starting the
memory streams again), and at 64 rows those costs are a good part of the call. vLLM builds its
models this way (QKVParallelLinear, MergedColumnParallelLinear).

Only lesson 14's packed linears are fused (bf16, and float32 on x86: the CPU path this lesson
compiles); anything another lesson put in their place (quantized, tensor-parallel) is left as
it is.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from step04_transformer.layers import SwiGLU
from step04_transformer.model import SelfAttention
from step14_batched_forward.packed_linear import PackedLinear, count_modules, replace_modules
from step16_cuda_graph.cpu.ops import elementwise_fits


def stacked(parts: list[PackedLinear]) -> PackedLinear:
    """One PackedLinear whose weight rows are those of `parts`, in order (bias too, if any)."""
    weights = [p.packed.to_dense() for p in parts]          # oneDNN's layout back to [out, in]
    linear = nn.Linear(parts[0].in_features, sum(w.shape[0] for w in weights), bias=parts[0].bias is not None,
                       device="meta")
    linear.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return PackedLinear(linear)


class FusedQKVAttention(SelfAttention):
    """Lesson 04's attention with q, k and v from one matmul."""

    def __init__(self, attn: SelfAttention, kernels: bool = False, qkv_proj: nn.Module | None = None):
        """qkv_proj: the fused projection made elsewhere (advanced 01 stacks quantized blocks);
        by default lesson 14's packed q, k and v, stacked."""
        nn.Module.__init__(self)
        self.layer_idx, self.nh, self.nkv, self.hd = attn.layer_idx, attn.nh, attn.nkv, attn.hd
        self.qkv_proj = qkv_proj if qkv_proj is not None else stacked([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj, self.q_norm, self.k_norm = attn.o_proj, attn.q_norm, attn.k_norm
        self.kernels = kernels           # q/k norm + RoPE as one C pass (ops.qk_norm_rope)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn) -> Tensor:
        if not self.kernels:
            return super().forward(x, cos, sin, attn)
        T, nh, nkv, hd = x.shape[0], self.nh, self.nkv, self.hd
        qkv = self.qkv_proj(x)
        norms = self.q_norm is not None
        q, k = torch.ops.minivllm.qk_norm_rope(qkv, self.q_norm.weight if norms else None,
                                               self.k_norm.weight if norms else None, cos, sin, nh, nkv,
                                               self.q_norm.eps if norms else 0.0)
        v = qkv[:, (nh + nkv) * hd:].view(T, nkv, hd)
        return self.o_proj(attn(self.layer_idx, q, k, v).reshape(T, nh * hd))

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        return q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)


class FusedSwiGLU(SwiGLU):
    """Lesson 04's MLP with gate and up from one matmul."""

    def __init__(self, mlp: SwiGLU, kernels: bool = False, gate_up_proj: nn.Module | None = None):
        nn.Module.__init__(self)
        self.gate_up_proj = gate_up_proj if gate_up_proj is not None else stacked([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.kernels = kernels           # silu(gate) * up as one C pass (ops.silu_mul)

    def forward(self, x: Tensor) -> Tensor:
        if not self.kernels:
            return super().forward(x)
        return self.down_proj(torch.ops.minivllm.silu_mul(self.gate_up_proj(x)))

    def project_gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.gate_up_proj(x).chunk(2, dim=-1)


def fuse_projections(model: nn.Module, kernels: bool = False) -> nn.Module:
    """`model` with every attention and MLP whose projections are all lesson 14's PackedLinear
    replaced by its fused version (a new model: `model` is not changed). A model fused already
    has nothing left to replace; `count_modules` says how many were.

    kernels: the element-wise chains after the fused projections go to elementwise.cpp (bf16
    models only; its AVX-512 BF16 build or its portable one) instead of torch's ops."""
    bf16 = model.model.embed_tokens.weight.dtype == torch.bfloat16       # the C passes are bf16 only
    kernels = kernels and bf16 and elementwise_fits(model.config.head_dim, model.config.intermediate_size)

    def fuse(m: nn.Module) -> nn.Module | None:
        if type(m) is SelfAttention and all(type(p) is PackedLinear for p in (m.q_proj, m.k_proj, m.v_proj)):
            return FusedQKVAttention(m, kernels)
        if type(m) is SwiGLU and all(type(p) is PackedLinear for p in (m.gate_proj, m.up_proj)):
            return FusedSwiGLU(m, kernels)
        return None
    return replace_modules(model, fuse)


def count_fused(model: nn.Module) -> int:
    return count_modules(model, FusedQKVAttention) + count_modules(model, FusedSwiGLU)
