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


@library_op("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, Tensor? ours) -> Tensor",
            fake=lambda x, packed_weight, bias, out_features, ours: x.new_empty(x.shape[0], out_features))
def packed_linear(x: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int,
                  ours: Tensor | None) -> Tensor:
    """x [N, in] @ W^T + b with W in oneDNN's blocked layout: lesson 14's call. With `ours` (our
    own copy of W, see OpPackedLinear): gemm_f32 on its panels (3-D) for float32 steps of up
    to gemm_f32_rows() rows, our GEMV on its plain layout (2-D) for a few bf16 rows."""
    if ours is not None:
        if ours.dim() == 3 and x.shape[0] <= gemm_f32_rows():
            return gemm_f32(x, ours, out_features, bias)
        if x.shape[0] <= gemv_rows(x.dtype):
            return gemv(x, ours)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def gemv_max_rows() -> int:
    """Most rows elementwise.cpp's gemv_bf16 takes (0: not in this build of the library)."""
    lib = kernels_library()
    return lib.gemv_rows if lib is not None else 0


def gemv_rows(dtype: torch.dtype) -> int:
    """Most rows our GEMV takes for activations of `dtype`: gemv_bf16's for bf16; 0 for other
    dtypes (float32 steps of any size go to gemm_f32 where the build has it)."""
    return gemv_max_rows() if dtype == torch.bfloat16 else 0


def gemv(x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T for bf16 x of M <= gemv_rows(bf16) rows, K % 32 == 0, weight
    bf16 (gemv_bf16). out: a contiguous float32 [M, N] to write into instead (results widened)."""
    x = x.contiguous()
    lib, (M, K), N = kernels_library(), x.shape, weight.shape[0]
    if out is None:
        y = x.new_empty(M, N)
        lib.gemv_bf16(x.data_ptr(), M, K, weight.data_ptr(), N, y.data_ptr())
        return y
    if out.dtype != torch.float32 or out.shape != (M, N) or not out.is_contiguous():
        raise ValueError(f"gemv out: a contiguous float32 [{M}, {N}], got {out.dtype} {tuple(out.shape)}")
    lib.gemv_bf16_f32(x.data_ptr(), M, K, weight.data_ptr(), N, out.data_ptr())
    return out


# gemm_f32.h reads a panel's 16 bf16 as columns 0-3, 8-11, 4-7, 12-15 (see there).
BF16_PANEL_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def gemm_f32_rows() -> int:
    """Most rows of a float32 step gemm_f32 takes in this build: every step where AVX2 is the
    widest unit, steps of up to 48 rows where there is AVX-512 (oneDNN's packed call takes
    larger ones); 0 where it is not built."""
    lib = kernels_library()
    return lib.gemm_f32_rows if lib is not None else 0


def pack_f32(weight: Tensor) -> Tensor:
    """A float32 weight [N, K] packed for gemm_f32: panels [ceil(N / 16), K, 16], column j of
    panel p being output 16p + j (the last panel padded with zeros). As bf16 where every value
    is a bf16 value (a bf16 checkpoint loaded as float32: the same numbers in half the bytes),
    with each panel's columns in BF16_PANEL_ORDER; else as float32."""
    N, K = weight.shape
    padded = weight.new_zeros(-(-N // 16) * 16, K)
    padded[:N] = weight
    panels = padded.view(-1, 16, K).transpose(1, 2)
    narrow = plain_bf16(weight)
    if narrow is not None:
        panels = panels[..., BF16_PANEL_ORDER].bfloat16()
    return panels.contiguous()


def gemm_f32(x: Tensor, panels: Tensor, out_features: int, bias: Tensor | None = None,
             out: Tensor | None = None) -> Tensor:
    """x [M, K] float32 @ W^T (+ bias) with W packed by pack_f32, any M; float32 [M, out]
    (written into `out`, a contiguous float32 [M, out_features], when given)."""
    x = x.contiguous()
    M, K = x.shape
    y = x.new_empty(M, out_features) if out is None else out
    if y.dtype != torch.float32 or y.shape != (M, out_features) or not y.is_contiguous():
        raise ValueError(f"gemm_f32 out: a contiguous float32 [{M}, {out_features}], got {y.dtype} {tuple(y.shape)}")
    if x.dtype != torch.float32 or panels.shape[1:] != (K, 16) or panels.shape[0] * 16 < out_features:
        raise ValueError(f"gemm_f32: float32 x [M, {K}] and panels [{-(-out_features // 16)}, {K}, 16], "
                         f"got {x.dtype} {tuple(x.shape)} and {tuple(panels.shape)}")
    bias_ptr = None if bias is None else bias.float().contiguous().data_ptr()
    kernels_library().gemm_f32(x.data_ptr(), M, K, panels.data_ptr(), int(panels.dtype == torch.bfloat16),
                               out_features, bias_ptr, y.data_ptr())
    return y


class OpPackedLinear(PackedLinear):
    """Lesson 14's PackedLinear, called through the custom op (same weights, same numbers).

    small_rows: also keep a copy of the weight in a layout our own kernels read (memory: the
    weight once more, on 2 MB pages where the OS grants them), where the library has them:
      bf16 weights      their plain [out, in] layout (`dense`): steps of at most gemv_rows() rows
                        with gemv_bf16 (a decode step of one to four sequences: the case one
                        conversation is); without bias, in_features % 32 == 0
      float32 weights   gemm_f32's panels (`panels`, pack_f32; bf16 where the values are bf16
                        values): float32 steps of up to gemm_f32_rows() rows (every step where
                        AVX2 is the CPU's widest unit, up to 48 rows where it has AVX-512)
    `bench.py batch1`, lesson 18's llamacpp_bench and `cpu/bench.py linears` measure them."""

    def __init__(self, packed: PackedLinear, small_rows: bool = True):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.packed, self.bias = packed.packed, packed.bias
        self.dense = self.panels = None
        dtype = packed.packed.dtype
        if small_rows and dtype == torch.float32 and gemm_f32_rows() > 0:
            self.panels = on_huge_pages(pack_f32(packed.packed.to_dense()))
        elif small_rows and gemv_rows(dtype) > 0 and packed.bias is None and packed.in_features % 32 == 0:
            dense = plain_bf16(packed.packed.to_dense().contiguous())
            self.dense = None if dense is None else on_huge_pages(dense)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if not torch.compiler.is_compiling():       # eager: skip the op's dispatch cost (~us per call)
            if self.panels is not None and x2.shape[0] <= gemm_f32_rows():
                return gemm_f32(x2, self.panels, self.out_features, self.bias).view(*x.shape[:-1], self.out_features)
            if self.dense is not None and x2.shape[0] <= gemv_rows(x2.dtype):
                return gemv(x2, self.dense).view(*x.shape[:-1], self.out_features)
            return super().forward(x)
        ours = self.panels if self.panels is not None else self.dense
        y = packed_linear(x2, self.packed, self.bias, self.out_features, ours)
        return y.view(*x.shape[:-1], self.out_features)


def on_huge_pages(t: Tensor) -> Tensor:
    """`t` copied onto 2 MB pages where the OS grants them (huge_pages.py), else `t` itself."""
    copy = huge_page_copy(t)
    return t if copy is None else copy


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
    lib.gemm_f32_rows = 0                             # gemm_f32: x86 builds with AVX2 (gemm_f32.h)
    if bind(lib, "gemm_f32_max_rows", [], i64) and bind(lib, "gemm_f32", [ptr, i64, i64, ptr, i64, i64, ptr, ptr]):
        lib.gemm_f32_rows = int(lib.gemm_f32_max_rows())
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
