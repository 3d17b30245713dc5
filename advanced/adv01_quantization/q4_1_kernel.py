"""The file's Q4_1 blocks on a kernel of our own, inside lesson 16's fast path.

gguf_q4_1.py gives the blocks to torch's int4 kernel, which only an eager engine can call here:
a decode step of the embedded model then pays lesson 15's per-op costs, and torch's kernel wants
its own packed layout and bf16 scales (d and m rounded). This module keeps the blocks as the file
stores them and multiplies with them in C (q4_1_gemv.cpp):

    Q41Linear          qs [N, K/32, 16] uint8 (the file's nibbles), d and m [N, K/32] float32
                       (the file's float16 values, exact); forward: the `minivllm::q4_1_linear`
                       op, so compiled code calls it as one opaque node
    q4_1_fast_model    the embedded SmolLM2 with every Q4_1 linear of the file as a Q41Linear,
                       q|k|v and gate|up stacked row-wise (one matrix each, as lesson 16 fuses
                       bf16 ones: a block belongs to one row, so rows stack as they are), in
                       lesson 16's FusedQKVAttention / FusedSwiGLU
    q4_1_engine        lesson 16's fast-path engine on that model: steps of one to four rows run
                       every layer in one C call (lesson 16's decode_step.py), whose plan calls
                       q4_1_linear for these linears (registered below as their format)

The weights are w = d q + m in float32, the file's own values, so the only rounding against the
file's float copy is the order of the float32 sums and the bf16 activations.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

from advanced.adv01_quantization.gguf_q4_1 import Q41Blocks, embedded_gguf, read_q4_1
from minivllm_support.cpu import auto_dtype
from minivllm_support.models import embedded_smollm2
from step04_transformer.loader import load_model
from step04_transformer.model import DecoderLayer
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward import kernel as lesson14_kernel
from step14_batched_forward.packed_linear import replace_modules
from step16_cuda_graph.cpu import decode_step
from step16_cuda_graph.cpu.engine import build_engine
from step16_cuda_graph.cpu.fused import FusedQKVAttention, FusedSwiGLU
from step16_cuda_graph.cpu.huge_pages import huge_page_copy
from step16_cuda_graph.cpu.ops import LESSON14_DIR, elementwise_fits, library_op

SOURCE = Path(__file__).with_name("q4_1_gemv.cpp")
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class Q41Matrix(ctypes.Structure):
    """q4_1_gemv.cpp's Q41Matrix: where one weight's nibbles and scales are."""
    _fields_ = [("qs", _ptr), ("d", _ptr), ("m", _ptr)]


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    lib = lesson14_kernel.build_or_warn(SOURCE, "the Q4_1 kernel is unavailable", (LESSON14_DIR,))
    if lib is None or not lesson14_kernel.bind(lib, "q4_1_available", [], _i64):
        return None
    for name in ("q4_1_linear", "q4_1_linear_f32"):
        lesson14_kernel.bind(lib, name, [_ptr, _ptr, _i64, _i64, _i64, _ptr])
    return lib


def pack_nibbles(q: Tensor) -> Tensor:
    """q [N, K] of 0..15 -> the file's bytes [N, K/32, 16]: byte j of a block holds weight j
    (low nibble) and weight j + 16 (high)."""
    blocks = q.to(torch.uint8).view(q.shape[0], -1, 32)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).contiguous()


@library_op("q4_1_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor",
            fake=lambda x, qs, d, m: x.new_empty(x.shape[0], d.shape[0]))
def q4_1_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """x [M, K] @ W^T, W in Q4_1 blocks (qs, d, m as Q41Linear holds them) -> [M, N], bf16 or
    float32 as x."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], d.shape[0])
    matrix = Q41Matrix(qs.data_ptr(), d.data_ptr(), m.data_ptr())
    fn = load().q4_1_linear_f32 if x.dtype == torch.float32 else load().q4_1_linear
    fn(ctypes.addressof(matrix), x.data_ptr(), x.shape[0], x.shape[1], d.shape[0], y.data_ptr())
    return y


def on_huge_pages(t: Tensor) -> Tensor:
    copy = huge_page_copy(t)
    return t if copy is None else copy


class Q41Linear(nn.Module):
    """A linear whose weight is Q4_1 blocks (bf16 or float32 activations in and out, no bias)."""

    def __init__(self, blocks: list[Q41Blocks]):
        super().__init__()
        q = torch.cat([b.q for b in blocks])                # rows of several weights, stacked
        # On 2 MB pages where the OS grants them (lesson 16's huge_pages.py): a decode step of a
        # few rows streams all three once, without a TLB miss every 4 KB.
        self.register_buffer("qs", on_huge_pages(pack_nibbles(q)))
        self.register_buffer("d", on_huge_pages(torch.cat([b.d for b in blocks]).float().contiguous()))
        self.register_buffer("m", on_huge_pages(torch.cat([b.m for b in blocks]).float().contiguous()))
        self.out_features, self.in_features = q.shape
        # for lesson 16's one-call plan: the struct its loop hands to q4_1_linear
        self.matrix = Q41Matrix(self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr())

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.minivllm.q4_1_linear(x.reshape(-1, self.in_features), self.qs, self.d, self.m)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> Tensor:
        """float32 [N, K]: d q + m, the file's own values."""
        q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()          # [N, K/32, 32]
        return (q * self.d[..., None] + self.m[..., None]).reshape(self.out_features, self.in_features)


def _q4_1_entry(name: str):
    def entry(linear: Q41Linear) -> decode_step.LinearEntry | None:
        lib = load()
        if lib is None:
            return None
        return ctypes.addressof(linear.matrix), ctypes.cast(getattr(lib, name), _ptr).value, [linear.qs, linear.d, linear.m]
    return entry


decode_step.register_linear_format(Q41Linear, _q4_1_entry("q4_1_linear"), torch.bfloat16)
decode_step.register_linear_format(Q41Linear, _q4_1_entry("q4_1_linear_f32"), torch.float32)


def q4_1_fast_model(model: nn.Module, path: Path | None = None) -> nn.Module:
    """`model` (lesson 04's, bf16 or float32, as loaded: unfused) with every layer whose seven
    linears the file holds in Q4_1 rebuilt on Q41Linear, q|k|v and gate|up stacked. A new model."""
    if load() is None:
        raise RuntimeError("the Q4_1 kernel could not be built here (see the warning above)")
    cfg, dtype = model.config, model.model.embed_tokens.weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q4_1_fast_model takes a bf16 or float32 model (its kernel's activations), not {dtype}")
    blocks, _ = read_q4_1(path or embedded_gguf(), cfg.num_heads, cfg.num_kv_heads)
    # elementwise.cpp's passes are bf16 only, as lesson 16's fuse_projections has it
    kernels = dtype == torch.bfloat16 and elementwise_fits(cfg.head_dim, cfg.intermediate_size)
    names = {id(m): name for name, m in model.named_modules()}

    def rebuild(layer: nn.Module) -> nn.Module | None:
        if type(layer) is not DecoderLayer:
            return None
        prefix = names[id(layer)]
        b = {key.removeprefix(prefix + "."): v for key, v in blocks.items() if key.startswith(prefix + ".")}
        if len(b) != 7:
            return None
        attn = FusedQKVAttention(layer.self_attn, kernels, qkv_proj=Q41Linear(
            [b["self_attn.q_proj"], b["self_attn.k_proj"], b["self_attn.v_proj"]]))
        attn.o_proj = Q41Linear([b["self_attn.o_proj"]])
        mlp = FusedSwiGLU(layer.mlp, kernels, gate_up_proj=Q41Linear([b["mlp.gate_proj"], b["mlp.up_proj"]]))
        mlp.down_proj = Q41Linear([b["mlp.down_proj"]])
        return replace_modules(layer, lambda m: attn if m is layer.self_attn else mlp if m is layer.mlp else None)
    return replace_modules(model, rebuild)


def q4_1_engine(config: PagedSchedulerConfig | None = None, dtype: torch.dtype | None = None, **options):
    """Lesson 16's fast-path engine on the embedded SmolLM2 with the file's Q4_1 blocks;
    activations in `dtype` (default: this CPU's auto dtype, bf16 where it multiplies bf16, else
    float32); embedding and tied LM head the bf16 copy, as in q4_1_llm (in float32: those values)."""
    model = load_model(embedded_smollm2(), torch.bfloat16).to(dtype or auto_dtype())
    return build_engine(q4_1_fast_model(model), config, **options)
