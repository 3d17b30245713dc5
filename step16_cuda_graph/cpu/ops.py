"""Our kernels as PyTorch custom ops, so torch.compile calls them instead of tracing into them.

A compiler can only fuse what it can see. torch.compile traces Python into a graph of
PyTorch ops; some of our layers are not PyTorch ops it understands:

    the paged attention kernel   a C function called through ctypes (lesson 15; prompt chunks
                                 on AMX tiles: lesson 15's amx_prefill.cpp): not traceable
    the packed linear            oneDNN's blocked weight (lesson 14): inductor's own lowering
                                 of `mkldnn._linear_pointwise` rejects it as a graph input
    qk_norm_rope, silu_mul       this lesson's C passes (elementwise.cpp), called through ctypes

Registered with `torch.library` (`library_op` below), each becomes one opaque node: the
compiler fuses the element-wise work around it and calls our function where the node stands.
The "fake" implementation tells it the output's shape and dtype without running anything.

The attention op also writes the step's K/V into the pool, and its schema says so
(`Tensor(a!) k_cache`): the compiler then keeps the write in order and in place, and never
copies the pool to stay "functional".
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from step14_batched_forward import kernel as lesson14_kernel
from step14_batched_forward.packed_linear import PackedLinear, replace_modules
from step15_flash_attention.amx_prefill import amx_prefill, amx_prefill_fits
from step15_flash_attention.flash_cpu import flash_attention_cpu
from step16_cuda_graph.cpu.huge_pages import huge_page_copy

ELEMENTWISE_SOURCE = Path(__file__).with_name("elementwise.cpp")
LESSON14_DIR = Path(lesson14_kernel.__file__).parent      # isa.h
_LIBRARY = torch.library.Library("minivllm", "FRAGMENT")


def library_op(schema: str, fake):
    """Register the decorated function as the op `minivllm::<schema>` and return the op (so
    that every caller goes through the dispatcher, and the compiler sees one opaque node).
    The schema declares what the op writes, as ATen's do: `Tensor(a!) x` is mutated in place.
    `torch.library.custom_op` would build the schema from type hints, but it wraps each call
    in more Python (a decode step makes 196 such calls; `bench.py linears` prints what one
    costs in a compiled graph). `fake` gives the compiler the output's shape."""
    def register(fn):
        name = schema.split("(")[0]
        _LIBRARY.define(schema)
        for key in ("CPU", "MkldnnCPU"):          # plain tensors, and oneDNN-packed weights
            _LIBRARY.impl(name, fn, key)
        torch.library.register_fake(f"minivllm::{name}", fake)
        return getattr(torch.ops.minivllm, name)
    return register


@library_op("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, "
            "Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_tables) -> Tensor",
            fake=lambda q, *args: torch.empty_like(q))
def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor,
                    cu_seqlens_q: Tensor, seq_lens: Tensor, block_tables: Tensor) -> Tensor:
    """Write k/v [T, Hkv, D] at `rows` of the head-major pool, then lesson 15's kernel; a bf16
    step with prompt rows on a CPU with AMX tiles: `prompts_apart`.

    The runner checked the metadata once for the step (a check here would run every layer).
    """
    write_kv(k, v, k_cache, v_cache, rows)
    if q.shape[0] > seq_lens.shape[0] and amx_prefill_fits(q, k_cache):   # prompt rows, and tiles for them
        return prompts_apart(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    return flash_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, check=False)


def prompts_apart(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                  block_tables: Tensor) -> Tensor:
    """A bf16 step with prompt rows on a CPU with AMX tiles: the prompt chunks go to the matrix
    unit (one call of lesson 15's amx_prefill.cpp for all of them, keys read from the pool where
    this step's rows were just written), the decodes to lesson 15's kernel as a sub-batch.

    Without tiles every row stays with lesson 15's kernel: on a CPU of AVX-512 or AVX2 it is
    faster than torch's SDPA for the prompt chunks a step holds (up to 512 queries; `bench.py
    prefill` and lesson 15's `bench.py kernel` measure both). In float32 the tests hold the
    engine to lesson 15 exactly; here, to bf16 rounding."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    amx_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    decodes = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decodes:
        rows, idx = torch.tensor([cu[b] for b in decodes]), torch.tensor(decodes)
        out[rows] = flash_attention_cpu(q[rows], k_cache, v_cache, torch.arange(len(decodes) + 1),
                                        seq_lens[idx], block_tables[idx], check=False)
    return out


@library_op("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, Tensor? dense) -> Tensor",
            fake=lambda x, packed_weight, bias, out_features, dense: x.new_empty(x.shape[0], out_features))
def packed_linear(x: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int,
                  dense: Tensor | None) -> Tensor:
    """x [N, in] @ W^T + b with W in oneDNN's blocked layout: lesson 14's call. With `dense` (the
    same W in its plain layout, see OpPackedLinear) and a few rows: our GEMV on it instead."""
    if dense is not None and x.shape[0] <= gemv_rows(x.dtype):
        return gemv(x, dense)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def gemv_max_rows() -> int:
    """Most rows elementwise.cpp's gemv_bf16 takes (0: not in this build of the library)."""
    lib = kernels_library()
    return lib.gemv_rows if lib is not None else 0


def gemv_rows(dtype: torch.dtype) -> int:
    """Most rows our GEMV takes for activations of `dtype`: gemv_bf16 for bf16, gemv_f32 (a
    weight stored as bf16, gemv_f32.h) for float32; 0 where this build has none for it."""
    lib = kernels_library()
    if lib is None:
        return 0
    return {torch.bfloat16: lib.gemv_rows, torch.float32: lib.gemv_f32_rows}.get(dtype, 0)


def gemv(x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T for M <= gemv_rows(x.dtype), K % 32 == 0, weight bf16: in bf16
    (gemv_bf16), or for float32 x in float32 with the weight widened (gemv_f32, float32 out).
    out: a contiguous float32 [M, N] to write into instead (bf16 results widened)."""
    x = x.contiguous()
    lib, (M, K), N = kernels_library(), x.shape, weight.shape[0]
    if x.dtype == torch.float32:
        y = x.new_empty(M, N) if out is None else out
        if y.dtype != torch.float32 or y.shape != (M, N) or not y.is_contiguous():
            raise ValueError(f"gemv out: a contiguous float32 [{M}, {N}], got {y.dtype} {tuple(y.shape)}")
        lib.gemv_f32(x.data_ptr(), M, K, weight.data_ptr(), N, y.data_ptr())
        return y
    if out is None:
        y = x.new_empty(M, N)
        lib.gemv_bf16(x.data_ptr(), M, K, weight.data_ptr(), N, y.data_ptr())
        return y
    if out.dtype != torch.float32 or out.shape != (M, N) or not out.is_contiguous():
        raise ValueError(f"gemv out: a contiguous float32 [{M}, {N}], got {out.dtype} {tuple(out.shape)}")
    lib.gemv_bf16_f32(x.data_ptr(), M, K, weight.data_ptr(), N, out.data_ptr())
    return out


class OpPackedLinear(PackedLinear):
    """Lesson 14's PackedLinear, called through the custom op (same weights, same numbers).

    small_rows: also keep the weight in its plain [out, in] layout (memory: the weight once more)
    and compute steps of at most gemv_rows() rows with our GEMV (a decode step of one to four
    sequences: the case one conversation is); weights without bias, in_features % 32 == 0,
    where the library has it: bf16 weights with gemv_bf16, float32 weights that are all bf16
    values (a bf16 checkpoint run in float32) stored as bf16 with gemv_f32. `bench.py batch1`
    and lesson 18's llamacpp_bench measure it."""

    def __init__(self, packed: PackedLinear, small_rows: bool = True):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.packed, self.bias = packed.packed, packed.bias
        self.dense = None
        if small_rows and gemv_rows(packed.packed.dtype) > 0 and packed.bias is None and packed.in_features % 32 == 0:
            dense = plain_bf16(packed.packed.to_dense().contiguous())
            if dense is not None:                   # on 2 MB pages where the OS grants them (huge_pages.py)
                on_huge_pages = huge_page_copy(dense)
                self.dense = dense if on_huge_pages is None else on_huge_pages

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if not torch.compiler.is_compiling():       # eager: skip the op's dispatch cost (~us per call)
            if self.dense is not None and x2.shape[0] <= gemv_rows(x2.dtype):
                return gemv(x2, self.dense).view(*x.shape[:-1], self.out_features)
            return super().forward(x)
        y = packed_linear(x2, self.packed, self.bias, self.out_features, self.dense)
        return y.view(*x.shape[:-1], self.out_features)


def plain_bf16(weight: Tensor) -> Tensor | None:
    """`weight` as bf16 for our GEMV: itself if bf16; a bf16 copy of a float32 weight whose every
    value is a bf16 value (so the copy is exact); else None."""
    if weight.dtype == torch.bfloat16:
        return weight
    if weight.dtype != torch.float32:
        return None
    narrow = weight.bfloat16()
    return narrow if torch.equal(narrow.float(), weight) else None


def route_packed_linears(model: torch.nn.Module, small_rows: bool = True) -> torch.nn.Module:
    """`model` with every PackedLinear swapped for an OpPackedLinear sharing its weight (a new
    model, lesson 14's `replace_modules`; `model` is not changed). small_rows: see OpPackedLinear."""
    return replace_modules(model, lambda m: OpPackedLinear(m, small_rows) if type(m) is PackedLinear else None)


# ---- element-wise chains of a bf16 layer as one C pass each (elementwise.cpp) ---------------
@lru_cache(maxsize=None)
def kernels_library() -> ctypes.CDLL | None:
    """elementwise.cpp built for this CPU (its AVX-512 BF16 build or its portable one: ask
    `lesson14_kernel.isa(lib)`), or None (no compiler, MINIVLLM_KERNEL=0). The element-wise
    passes are bound only if the library exports them (`has_elementwise`); else torch's ops run."""
    lib = lesson14_kernel.build_or_warn(ELEMENTWISE_SOURCE, "lesson 16's fast-path C kernels unavailable, torch's ops run instead",
                                        (LESSON14_DIR,))
    if lib is None:
        return None
    i64, ptr, bind = ctypes.c_int64, ctypes.c_void_p, lesson14_kernel.bind
    bind(lib, "write_kv", [ptr, ptr] + [i64] * 5 + [ptr, ptr, ptr, i64, i64])
    bind(lib, "row_argmax_f32", [ptr, i64, i64, i64, ptr])
    lib.gemv_rows = 0                                 # gemv_bf16: its AVX-512 BF16 build only
    if (bind(lib, "gemv_max_rows", [], i64) and bind(lib, "gemv_bf16", [ptr, i64, i64, ptr, i64, ptr])
            and bind(lib, "gemv_bf16_f32", [ptr, i64, i64, ptr, i64, ptr])):
        lib.gemv_rows = int(lib.gemv_max_rows())
    lib.gemv_f32_rows = 0                             # gemv_f32: AVX2 builds (gemv_f32.h)
    if bind(lib, "gemv_f32_max_rows", [], i64) and bind(lib, "gemv_f32", [ptr, i64, i64, ptr, i64, ptr]):
        lib.gemv_f32_rows = int(lib.gemv_f32_max_rows())
    lib.has_elementwise = (bind(lib, "elementwise_available", [], i64) and bool(lib.elementwise_available())
                           and bind(lib, "qk_norm_rope_bf16", [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                                               ctypes.c_float, ptr, ptr])
                           and bind(lib, "silu_mul_bf16", [ptr, i64, i64, ptr]))
    return lib


def elementwise_library() -> ctypes.CDLL | None:
    """The library if its bf16 element-wise kernels are there, else None."""
    lib = kernels_library()
    return lib if lib is not None and lib.has_elementwise else None


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor) -> None:
    """k, v [T, Hkv, D] into rows `rows` ([T * Hkv], token-major) of the head-major pools."""
    lib, D = kernels_library(), k.shape[-1]
    if (lib is None or k.stride(-1) != 1 or v.stride(-1) != 1 or rows.dtype != torch.int64 or not rows.is_contiguous()
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        k_cache.view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
        v_cache.view(-1, D).index_copy_(0, rows, v.reshape(-1, D))
        return
    size = k.element_size()
    lib.write_kv(k.data_ptr(), v.data_ptr(), k.stride(0) * size, k.stride(1) * size, v.stride(0) * size,
                 v.stride(1) * size, k.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(),
                 rows.numel(), D * size)


def row_argmax(x: Tensor) -> Tensor:
    """x.max(dim=-1).indices for float32 rows [B, V] in one C pass on both cores (lesson 06's
    row_argmax is torch's single reduction); torch's where it does not apply."""
    lib = kernels_library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or x.device.type != "cpu" \
            or x.shape[1] == 0:
        return x.max(dim=-1).indices
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.row_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def elementwise_fits(head_dim: int, intermediate: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= 256 and intermediate % 16 == 0 and elementwise_library() is not None


def _qk_norm_rope_fake(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps):
    T, D = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty(T, num_heads, D), qkv.new_empty(T, num_kv_heads, D)


@library_op("qk_norm_rope(Tensor qkv, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, "
            "int num_heads, int num_kv_heads, float eps) -> (Tensor, Tensor)", fake=_qk_norm_rope_fake)
def qk_norm_rope(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor, sin: Tensor,
                 num_heads: int, num_kv_heads: int, eps: float) -> tuple[Tensor, Tensor]:
    """q [T, nh, D] and k [T, nkv, D] from the fused projection's output qkv [T, >= (nh+nkv) D]:
    per-head RMSNorm (when weights are given) and RoPE, as lesson 04 computes them in bf16.
    cos/sin: lesson 04's float32 tables for the step's positions, [T, 1, D]."""
    T, D = qkv.shape[0], cos.shape[-1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
    q, k = qkv.new_empty(T, num_heads, D), qkv.new_empty(T, num_kv_heads, D)
    ptr = lambda t: 0 if t is None else t.data_ptr()
    elementwise_library().qk_norm_rope_bf16(qkv.data_ptr(), T, qkv.stride(0), num_heads, num_kv_heads, D,
                                            ptr(q_weight), ptr(k_weight), cos.data_ptr(), sin.data_ptr(), eps,
                                            q.data_ptr(), k.data_ptr())
    return q, k


@library_op("silu_mul(Tensor gate_up) -> Tensor",
            fake=lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [N, 2I] = gate | up, rounded as lesson 04 rounds in bf16."""
    gate_up = gate_up.contiguous()
    N, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(N, I)
    elementwise_library().silu_mul_bf16(gate_up.data_ptr(), N, I, out.data_ptr())
    return out
