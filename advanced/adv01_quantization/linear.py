"""Quantized linear layers on torch's CPU weight-only kernels, and the model transform that
puts them in a model's place.

    Int8Linear   y = x @ (q * scale)^T      torch.ops.aten._weight_int8pack_mm(x, q, scale)
    Int4Linear   y = x @ ((q-8)*s + z)^T    torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
                                            (float32 x: the weight widened, then F.linear)

Both kernels read the small integers and turn them into floats inside the multiply, so a
decode step reads 1 byte (int8) or half a byte (int4) per weight instead of bf16's 2. Their
contract, found by trying them on torch 2.13 (the tests pin it):
  - x is [M, K], contiguous, bf16 / fp16 / fp32; scales (and zeros) must have x's dtype;
  - int8: q is int8 [N, K], scale [N]; the result is x @ (q * scale)^T in x's dtype;
  - int4: q goes in as int32 [N, K] holding 0..15 and `_convert_weight_to_int4pack_for_cpu`
    packs it into uint8 [N, K/2] (a layout of its own, N a multiple of 16); scale and zero
    travel as one tensor [K/g, N, 2]; every weight is fma(q - 8, scale, zero) in float32;
    g is 32, 64, 128 or 256.

Both kernels walk the rows of x a few at a time with AVX-512 FMAs and no matrix unit (AMX),
so their cost grows with the number of rows: they win while a step is bound by reading the
weights (few rows) and lose to oneDNN's bf16 AMX matmul (lesson 14's PackedLinear) once it is
bound by arithmetic. Int8Linear therefore switches, above `dequant_rows` rows, to converting
its int8 weight to bf16 (exact: bf16 holds every integer up to 256) and running the bf16
matmul, scaling the result per output row: vLLM's AWQ layer makes the same switch at 256
tokens on a GPU. Int4 has no such cheap path in plain torch (see the README).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from advanced.adv01_quantization.quantize import QuantizedWeight, QuantScheme, check_shape, quantize
from step04_transformer.model import CausalLM
from step14_batched_forward.packed_linear import PackedLinear, count_modules, replace_modules

# Int8Linear: above this many rows, the bf16 matmul on the converted weight. run.py's rows sweep
# put the crossover between 8 and 16 rows on the Xeon this was written on.
DEQUANT_ROWS = 12


class _Scratch:
    """One bf16 buffer for the converted int8 weight, shared by every Int8Linear: allocating a
    fresh 6 MB tensor per call costs page faults (lesson 14's Workspace has the same reason).
    One per dtype and per inference mode: a tensor made under torch.inference_mode() cannot be
    written outside it."""
    buf: dict[tuple[torch.dtype, bool], Tensor] = {}

    @classmethod
    def get(cls, n: int, k: int, dtype: torch.dtype) -> Tensor:
        key = (dtype, torch.is_inference_mode_enabled())
        buf = cls.buf.get(key)
        if buf is None or buf.numel() < n * k:
            buf = cls.buf[key] = torch.empty(n * k, dtype=dtype)
        return buf[: n * k].view(n, k)


class Int8Linear(nn.Module):
    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, bias: Tensor | None = None,
                 dequant_rows: int | None = DEQUANT_ROWS):
        super().__init__()
        if qw.scheme.bits != 8:
            raise ValueError(f"Int8Linear needs an 8-bit QuantizedWeight, got {qw.scheme.name}")
        self.out_features, self.in_features = qw.shape
        self.dequant_rows = dequant_rows
        self.register_buffer("qweight", qw.q.contiguous())                # int8 [N, K]
        self.register_buffer("scales", qw.scale.to(dtype).contiguous())   # [N], the activations' dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.dequant_rows is not None and x2.shape[0] > self.dequant_rows:
            w = _Scratch.get(self.out_features, self.in_features, x2.dtype).copy_(self.qweight)
            y = F.linear(x2, w) * self.scales                     # each output feature times its scale
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Weights of 4 bits, two to a byte, in groups of g along K with a scale and a zero each.

    bf16 / fp16 activations go through torch's int4 kernel. float32 ones do not: that kernel
    runs float32 through a scalar loop (a whole text's forward took minutes), so in float32
    the weight is widened per call into a shared scratch buffer and multiplied by oneDNN, as
    Int8Linear does above `dequant_rows`.
    The widening is done in float64 and rounded once, so the weights are bit for bit the ones
    torch's kernel computes with its fused multiply-add. The bytes stored are the same either way.
    """

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, bias: Tensor | None = None):
        super().__init__()
        if qw.scheme.bits != 4:
            raise ValueError(f"Int4Linear needs a 4-bit QuantizedWeight, got {qw.scheme.name}")
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.scheme.group_size
        self.widen = dtype == torch.float32
        if self.widen:      # our own layout: byte j of a row holds weight 2j (low nibble) and 2j + 1
            packed = (qw.q[:, 0::2].to(torch.uint8) | (qw.q[:, 1::2].to(torch.uint8) << 4)).contiguous()
        else:               # innerKTiles (the 2) shapes the packing for CUDA's kernel; the CPU layout ignores it
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32), 2)
        self.register_buffer("packed", packed)                            # uint8 [N, K/2]
        sz = torch.stack([qw.scale.t(), qw.zero.t()], dim=-1)             # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def widened(self) -> Tensor:
        """float32 [N, K]: fma(q - 8, scale, zero) per weight, in a buffer shared by every Int4Linear."""
        n, k, g = self.out_features, self.in_features, self.group_size
        w = _Scratch.get(n, k, torch.float64)
        pairs = w.view(n, k // 2, 2)
        pairs[..., 0].copy_(self.packed & 0x0F)
        pairs[..., 1].copy_(self.packed >> 4)
        sz = self.scales_and_zeros.double()
        groups = w.view(n, k // g, g).sub_(8).mul_(sz[..., 0].t()[..., None]).add_(sz[..., 1].t()[..., None])
        return _Scratch.get(n, k, torch.float32).copy_(groups.view(n, k))   # (q - 8) s exact in float64: one rounding

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.widen:
            y = F.linear(x2, self.widened())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def quantized_linear(qw: QuantizedWeight, dtype: torch.dtype, bias: Tensor | None = None) -> nn.Module:
    return Int8Linear(qw, dtype, bias) if qw.scheme.bits == 8 else Int4Linear(qw, dtype, bias)


def dense_weight(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight [N, K], bias) of an nn.Linear or of lesson 14's PackedLinear (its oneDNN layout
    turned back into a plain tensor: the same numbers, only reordered)."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), module.bias
    if isinstance(module, PackedLinear):
        return module.packed.to_dense(), module.bias
    raise TypeError(f"expected nn.Linear or PackedLinear, got {type(module).__name__}")


def quantize_linears(model: nn.Module, scheme: QuantScheme) -> nn.Module:
    """`model` with every linear of the decoder layers (nn.Linear, or lesson 14's PackedLinear
    and lesson 16's fast-path fused or op-routed versions of it) swapped for its quantized version: a new
    model, `model` is not changed (lesson 14's `replace_modules`). `count_quantized` says how many.

    The embedding and the LM head are left alone (quantize_model does the head). Every weight is
    checked before any is quantized: a bad scheme raises, naming the layer.
    """
    dtype = model.model.embed_tokens.weight.dtype
    targets = {id(child): (child, f"model.layers.{path}.{name}")
               for path, parent in model.model.layers.named_modules()
               for name, child in parent.named_children() if isinstance(child, (nn.Linear, PackedLinear))}
    for m, path in targets.values():
        check_shape(torch.empty(m.out_features, m.in_features, device="meta"), scheme, path)

    def swap(m: nn.Module) -> nn.Module | None:
        if id(m) not in targets:
            return None
        weight, bias = dense_weight(m)
        return quantized_linear(quantize(weight, scheme, targets[id(m)][1]), dtype, bias)
    return replace_modules(model, swap)


class ModuleHeadLM(CausalLM):
    """Lesson 04's model whose LM head is a module called on the hidden states (a quantized
    linear), where lesson 04 multiplies by a weight matrix (its own or the tied embedding's)."""

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()


def head_weight(model: nn.Module) -> Tensor:
    """The LM head's weight: the tied embedding, or the model's own head (packed or not)."""
    return model.model.embed_tokens.weight if model.lm_head is None else dense_weight(model.lm_head)[0]


def with_head(model: CausalLM, head: nn.Module) -> ModuleHeadLM:
    """A shallow copy of `model` (sharing every module) whose logits come from `head`; the tied
    embedding stays what it is, the table the token ids are looked up in."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"with_head needs lesson 04's CausalLM, got {type(model).__name__}")
    new = copy.copy(model)
    new._modules = dict(model._modules)          # its own table of children: `model` keeps its head
    new.__class__ = ModuleHeadLM
    new.lm_head = head
    return new


def quantize_model(model: CausalLM, scheme: QuantScheme, head: QuantScheme | None = None) -> CausalLM:
    """The model transform of this lesson: the decoder linears quantized with `scheme` and, with
    `head`, the LM head too (a ModuleHeadLM). A new model; `model` is not changed. Apply it before
    the model is handed to an engine, as lesson 14's packing."""
    new = quantize_linears(model, scheme)
    if head is not None:
        dtype = model.model.embed_tokens.weight.dtype
        new = with_head(new, quantized_linear(quantize(head_weight(model), head, "lm_head"), dtype))
    return new


def count_quantized(model: nn.Module) -> int:
    return count_modules(model, Int8Linear) + count_modules(model, Int4Linear)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weights a forward reads: parameters, persistent buffers (quantized weights
    live in buffers) and lesson 14's packed tensors; RoPE tables and shared tensors once."""
    tensors: dict[int, Tensor] = {}
    for m in module.modules():
        found = list(m._parameters.values())
        found += [b for n, b in m._buffers.items() if n not in m._non_persistent_buffers_set]
        found += [m.packed] if isinstance(m, PackedLinear) else []
        tensors.update((id(t), t) for t in found if t is not None)
    return sum(t.numel() * t.element_size() for t in tensors.values())
