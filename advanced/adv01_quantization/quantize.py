"""Round-to-nearest (RTN) weight quantization: the numbers, with no kernel in sight.

Two schemes, both "weight-only" (W8A16, W4A16): the weights are stored in 8 or 4 bits, the
activations stay bf16 (or fp32), and the matmul turns each weight back into a float as it
reads it. Every stored integer `q` means one float:

    W8A16, per output channel (one scale per row of W, symmetric):
        w ~ q * scale                      q in [-127, 127] (int8)
    W4A16, per group of `group_size` weights along a row (asymmetric or symmetric):
        w ~ (q - 8) * scale + zero         q in [0, 15] (4 bits)

The W4A16 form is the one torch's CPU int4 kernel reads (it subtracts 8 itself), and it can
say both things: asymmetric (scale = (max - min) / 15, zero = min + 8 * scale, so that
w ~ q * scale + min: llama.cpp's Q4_1 is exactly this with groups of 32) and symmetric
(scale = absmax / 7, zero = 0).

Everything is computed in float32 here; the linear modules (linear.py) round scale and zero
to the model's dtype, because that is what the kernels take.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INT4_GROUP_SIZES = (32, 64, 128, 256)     # what torch's `_weight_int4pack_mm_for_cpu` accepts
INT4_ROWS_MULTIPLE = 16                   # `_convert_weight_to_int4pack_for_cpu` packs 16 rows at a time


@dataclass(frozen=True)
class QuantScheme:
    bits: int                       # 8 or 4
    group_size: int | None = None   # None: one scale per output row (per channel)
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"QuantScheme.bits must be 8 (W8A16) or 4 (W4A16), got {self.bits!r}")
        if self.bits == 8 and (self.group_size is not None or not self.symmetric):
            raise ValueError("QuantScheme: 8 bits means symmetric, one scale per output row "
                             f"(torch's int8 kernel takes no groups and no zero point), got group_size="
                             f"{self.group_size!r}, symmetric={self.symmetric!r}")
        if self.bits == 4 and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"QuantScheme.group_size for 4 bits must be one of {INT4_GROUP_SIZES} "
                             f"(the groups torch's int4 kernel reads), got {self.group_size!r}")

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "W8A16 per-channel"
        return f"W4A16 g{self.group_size} {'sym' if self.symmetric else 'asym'}"


W8A16 = QuantScheme(8)
W4A16 = QuantScheme(4, group_size=32, symmetric=False)     # Q4_1's recipe: min/max per 32 weights


@dataclass
class QuantizedWeight:
    """One weight matrix [N out, K in] in integers, with what turns them back into floats."""
    q: Tensor            # int8 [N, K] (8 bits) or uint8 [N, K] holding 0..15 (4 bits, not yet packed)
    scale: Tensor        # float32 [N] (8 bits) or [N, K / group_size] (4 bits)
    zero: Tensor | None  # float32 [N, K / group_size] (4 bits), None for 8 bits
    scheme: QuantScheme

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float32 weights a kernel computes from these integers when given scale and zero in
        `dtype` (rounded to it first). In float64, then rounded once: the kernels use one fused
        multiply-add per weight, which rounds once too."""
        scale = self.scale.to(dtype).double()
        if self.scheme.bits == 8:
            return (self.q.double() * scale[:, None]).float()
        g = self.scheme.group_size
        scale = scale.repeat_interleave(g, dim=1)
        zero = self.zero.to(dtype).double().repeat_interleave(g, dim=1)
        return ((self.q.double() - 8) * scale + zero).float()


def check_shape(weight: Tensor, scheme: QuantScheme, name: str = "weight") -> None:
    """Every reason a weight cannot be quantized with `scheme`, as a ValueError naming it."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: expected a 2-D float weight [out_features, in_features], "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if scheme.bits == 4:
        if k % scheme.group_size:
            raise ValueError(f"{name}: group_size {scheme.group_size} does not divide in_features {k}")
        if n % INT4_ROWS_MULTIPLE:
            raise ValueError(f"{name}: out_features {n} is not a multiple of {INT4_ROWS_MULTIPLE} "
                             f"(torch's int4 packing works on 16 rows at a time)")


def _safe_inverse(scale: Tensor) -> Tensor:
    # An all-zero row (or group) has scale 0: its q is 0 and it dequantizes to exactly 0 (or min).
    return torch.where(scale > 0, 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def quantize(weight: Tensor, scheme: QuantScheme, name: str = "weight") -> QuantizedWeight:
    """Round to nearest: each weight to the closest point of its row's (or group's) grid."""
    check_shape(weight, scheme, name)
    w = weight.detach().float()
    if scheme.bits == 8:
        scale = w.abs().amax(dim=1) / 127                     # the largest weight of the row -> +-127
        q = torch.round(w * _safe_inverse(scale)[:, None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(q, scale, None, scheme)
    n, k = w.shape
    groups = w.view(n, k // scheme.group_size, scheme.group_size)
    if scheme.symmetric:
        scale = groups.abs().amax(dim=2) / 7                  # [-7, 7] * scale covers +-absmax; -8 unused
        zero = torch.zeros_like(scale)
        q = torch.round(groups * _safe_inverse(scale)[..., None]).clamp_(-8, 7) + 8
    else:
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        scale = (hi - lo) / 15                                # min -> 0, max -> 15
        zero = lo + 8 * scale                                 # the kernel computes (q - 8) * scale + zero
        q = torch.round((groups - lo[..., None]) * _safe_inverse(scale)[..., None]).clamp_(0, 15)
    return QuantizedWeight(q.to(torch.uint8).view(n, k), scale, zero, scheme)
