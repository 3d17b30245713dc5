"""Linear layers with weights pre-packed for oneDNN, the CPU's matmul library.

`F.linear(x, W)` on a bf16 CPU tensor asks oneDNN for a matmul, and oneDNN first copies W
into its own blocked layout (tiles its AMX / AVX-512 instructions read in order), every call.
A decode step is bound by reading the weights, and that copy reads them once more and
writes them again: on this machine a 3072 x 1024 weight times 64 rows took 0.42 ms a call
unpacked and 0.25 ms packed (`step18_benchmark/microbench.py`).
Packing once at load time, as vLLM's CPU backend and torch.compile's "freezing" do, leaves one
read per step. The results are the same numbers: the packed matmul runs the same kernel.

Packing needs torch's oneDNN ops (`torch.ops.mkldnn`, in every x86 CPU build of torch), and
bf16 needs a CPU whose oneDNN computes bf16 (AVX-512 BF16 or AMX). float32 is packed on every
x86 CPU: there `F.linear` goes to MKL, and oneDNN's packed float32 matmul beat it 1.3-2.6x on
an AMD EPYC (`bench.py linears`, lesson 14's README), where MKL takes a slow path. The sums run
in another order, so packed float32 results differ from F.linear's in the last bits (~1e-6).
Where nothing applies (ARM: not measured there), `pack_linears` returns the model as it is.

`pack_linears` is a *model transform*: a function the caller applies before handing the model
to an engine (as gpt-fast's `apply_tp`), which returns a new model and leaves its argument as
it was (`replace_modules`). Lesson 16's fast path (fused projections), lesson 17 (sharding) and the advanced
quantization lesson add transforms of the same shape.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from minivllm_support import cpu


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The hint only picks a layout good for about that many rows; any row count works.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.view(*shape[:-1], self.out_features)


def can_pack(dtype: torch.dtype) -> bool:
    if dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return cpu.arch() == "x86_64"
    return bool(ops._is_mkldnn_bf16_supported())


def replace_modules(model: nn.Module, replace: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """`model` with every submodule for which `replace(m)` returns a module swapped for it.

    `model` itself is not changed: the modules on the way down to a replaced one are shallow
    copies with their own table of children; everything else (other modules, parameters,
    buffers) is shared. Keep the result, drop the original, and no weight is held twice."""
    new = replace(model)
    if new is not None:
        return new
    children = {name: replace_modules(child, replace) for name, child in model.named_children()}
    if all(children[name] is child for name, child in model.named_children()):
        return model
    clone = copy.copy(model)
    clone._modules = {**model._modules, **children}
    return clone


def count_modules(model: nn.Module, kind: type) -> int:
    return sum(type(m) is kind for m in model.modules())


def pack_linears(model: nn.Module) -> nn.Module:
    """`model` with every nn.Linear that can_pack replaced by a PackedLinear (a new model:
    `model` is left as it was). Like vLLM's `process_weights_after_loading`, done once after
    loading; `count_modules(m, PackedLinear)` says how many were packed."""
    def pack(m: nn.Module) -> nn.Module | None:
        # oneDNN's blocked layout is for its CPU matmuls; a GPU's linears stay as they are.
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and can_pack(m.weight.dtype):
            return PackedLinear(m)
        return None
    return replace_modules(model, pack)
