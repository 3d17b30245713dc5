"""Linear layers with weights pre-packed for oneDNN, the CPU's matmul library.

`F.linear(x, W)` on a bf16 CPU tensor asks oneDNN for a matmul, and oneDNN first copies W
into its own blocked layout (tiles its AMX / AVX-512 instructions read in order), every call.
A decode step is bound by reading the weights, and that copy reads them once more and
writes them again: on this machine a 3072 x 1024 weight times 64 rows took 0.42 ms a call
unpacked and 0.25 ms packed (`microbench.py`).
Packing once at load time, as vLLM's CPU backend and torch.compile's "freezing" do, leaves one
read per step. The results are the same numbers: the packed matmul runs the same kernel.

Packing needs torch's oneDNN ops (`torch.ops.mkldnn`, in every x86 CPU build of torch), and
bf16 needs a CPU whose oneDNN computes bf16 (AVX-512 BF16 or AMX). float32 is packed on every
x86 CPU: there `F.linear` goes to MKL, and oneDNN's packed float32 matmul beat it 1.3-2.6x on
an AMD EPYC (`bench.py linears`, lesson 14's README), where MKL takes a slow path. The sums run
in another order, so packed float32 results differ from F.linear's in the last bits (~1e-6).
Where nothing applies (ARM: not measured there), `pack_linears` leaves the model unchanged and
says how many layers it packed.
"""
from __future__ import annotations

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


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear inside `model` that can_pack by a PackedLinear, in place; returns how many.

    In place, like vLLM's `process_weights_after_loading`: the packed copy replaces the
    original, so the weights are not held twice.
    """
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # oneDNN's blocked layout is for its CPU matmuls; a GPU's linears stay as they are.
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and can_pack(child.weight.dtype):
                setattr(parent, name, PackedLinear(child))
                done += 1
    return done
