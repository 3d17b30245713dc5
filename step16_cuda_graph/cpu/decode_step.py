"""A decode step of one to four sequences as one C call: the CPU's closest thing to a CUDA graph.

A CUDA graph records a step's kernel launches once and replays them with one call. On the CPU
the compiled path (runner.py) already skips Dynamo, but each of a layer's seven ops still goes
through PyTorch's dispatcher, into Python, into ctypes, and inductor checks every input's size
and stride: a few microseconds a call, ~200 calls a step, next to a few hundred microseconds
of weights a layer at batch 1 (cpu/run.py measures the step both ways).

So for the small buckets (1, 2, 4 rows: one conversation, a few) the runner records a plan
instead of compiling the layer body:

    Python, once per bucket                     C, every step (decode_step.cpp)
    ------------------------------------       -------------------------------------------
    DecodePlan: shapes, eps, scale              for each layer:
      weights[l]: 10 pointers per layer           rms_norm -> gemv qkv -> qk_norm_rope
      (norms, plain bf16 weights, K/V pool)       -> write_kv -> attention (lesson 15)
      step buffers: rows, cu, lens, tables        -> gemv o + x -> rms_norm -> gemv gate|up
      scratch rows (q, k, qkv, ...)               -> silu_mul -> gemv down + x
    step(x, cos, sin) -> one ctypes call

The pointers stay valid as long as the runner lives: the plan keeps the tensors it points to
(weights, pool, static buffers, scratch). The same kernels as the compiled path run, with bf16
rounding at the same points, so tokens match it (tests: `test_step16_decode_step.py`).
Lesson 04's layers with the fast path applied (fused projections), in one of two dtypes:

    bf16      a CPU with AVX-512 BF16: gemv_bf16 on the plain copies, elementwise.cpp's passes
    float32   an x86 CPU with AVX2 + FMA (gemm_f32's builds): gemm_f32 on the panels, the
              float32 passes of decode_step.cpp (equal to the compiled path's to a few ulps:
              `test_step16_decode_step_f32.py`)

anything else keeps the compiled path.

Each linear of the plan is a (weight pointer, C function) pair, so the loop does not care how a
weight is stored. `LINEAR_FORMATS` says, per module class and dtype, how to get that pair: this
lesson registers its OpPackedLinear (bf16: the plain copy, `linear_bf16`; float32: the panels,
`linear_f32*`); a later lesson registers its own (advanced 01: Q4_1 blocks and their kernel)
with `register_linear_format`.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

from step04_transformer.layers import RMSNorm
from step04_transformer.model import DecoderLayer
from step14_batched_forward import kernel as lesson14_kernel
from step15_flash_attention import flash_cpu
from step16_cuda_graph.cpu.fused import FusedQKVAttention, FusedSwiGLU
from step16_cuda_graph.cpu.ops import LESSON14_DIR, OpPackedLinear, gemm_f32_rows, gemv_max_rows

SOURCE = Path(__file__).with_name("decode_step.cpp")
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class Linear(ctypes.Structure):
    _fields_ = [("w", _ptr), ("fn", _ptr)]


class LayerWeights(ctypes.Structure):
    _fields_ = ([(name, _ptr) for name in ("norm1", "q_norm", "k_norm", "norm2")]
                + [(name, Linear) for name in ("qkv", "o", "gate_up", "down")]
                + [(name, _ptr) for name in ("k_cache", "v_cache")])


class DecodePlan(ctypes.Structure):
    """decode_step.cpp's DecodePlan, field for field."""
    _fields_ = ([(n, _i64) for n in ("layers", "M", "hidden", "nh", "nkv", "D", "inter")]
                + [(n, ctypes.c_float) for n in ("eps", "qk_eps", "scale")]
                + [("attention", _ptr)]
                + [(n, _i64) for n in ("max_blocks", "block_size", "q_tile")]
                + [(n, _ptr) for n in ("rows", "cu", "lens", "tables", "weights",
                                       "normed", "qkv", "q", "k", "att", "proj", "gate_up", "act")])


LOOPS = {torch.bfloat16: "decode_layers_bf16", torch.float32: "decode_layers_f32"}


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    """The library (elementwise.cpp's kernels and the layer loops), or None where this CPU's
    build has no layer loop (neither AVX-512 BF16 nor AVX2 + FMA), no compiler, or
    MINIVLLM_KERNEL=0."""
    lib = lesson14_kernel.build_or_warn(SOURCE, "the one-call decode step is unavailable, the compiled path runs",
                                        (LESSON14_DIR, SOURCE.parent))
    if lib is None:
        return None
    found = [lesson14_kernel.bind(lib, name, [ctypes.POINTER(DecodePlan), _ptr, _ptr, _ptr]) for name in LOOPS.values()]
    return lib if any(found) else None


def has_loop(dtype: torch.dtype) -> bool:
    """Whether this CPU's build has the layer loop for activations of `dtype`."""
    return load() is not None and dtype in LOOPS and hasattr(load(), LOOPS[dtype])


def max_rows(dtype: torch.dtype) -> int:
    """The largest bucket a plan of `dtype` takes, 0 without the loop: gemv_bf16's limit (4) in
    bf16, and the same 4 in float32 (gemm_f32 takes any number of rows; the buckets of one
    conversation or a few are the ones where per-op cost weighs, and larger ones stay compiled)."""
    if not has_loop(dtype):
        return 0
    return gemv_max_rows() if dtype == torch.bfloat16 else min(4, gemm_f32_rows())


# (module class, dtype) -> f(module) = (weight address, C function address, tensors the address
# points into), or None where this module cannot be run by the loop (e.g. no copy kept)
LinearEntry = tuple[int, int, list[Tensor]]
LINEAR_FORMATS: dict[tuple[type, torch.dtype], Callable[[nn.Module], LinearEntry | None]] = {}


def register_linear_format(cls: type, entry: Callable[[nn.Module], LinearEntry | None],
                           dtype: torch.dtype = torch.bfloat16) -> None:
    LINEAR_FORMATS[cls, dtype] = entry


def linear_entry(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> LinearEntry | None:
    entry = LINEAR_FORMATS.get((type(module), dtype))
    return None if entry is None else entry(module)


def _plain_bf16(linear: OpPackedLinear) -> LinearEntry | None:
    """The plain [out, in] bf16 copy an OpPackedLinear keeps for small steps, through linear_bf16."""
    if linear.dense is None or not has_loop(torch.bfloat16):
        return None
    return linear.dense.data_ptr(), ctypes.cast(load().linear_bf16, _ptr).value, [linear.dense]


def _panels_f32(linear: OpPackedLinear) -> LinearEntry | None:
    """gemm_f32's panels an OpPackedLinear keeps for float32 steps (bf16 where the values are)."""
    if linear.panels is None or linear.bias is not None or not has_loop(torch.float32):
        return None
    fn = load().linear_f32_bf16_panels if linear.panels.dtype == torch.bfloat16 else load().linear_f32
    return linear.panels.data_ptr(), ctypes.cast(fn, _ptr).value, [linear.panels]


register_linear_format(OpPackedLinear, _plain_bf16)
register_linear_format(OpPackedLinear, _panels_f32, torch.float32)


def fits(model: nn.Module) -> bool:
    """Whether every layer is one the C loop computes: lesson 04's layer with the fast path's
    fused projections, linears of a format registered for the model's dtype (and, in bf16,
    elementwise.cpp's passes), and a kernel."""
    cfg, dtype = model.config, model.model.embed_tokens.weight.dtype
    if max_rows(dtype) < 1 or flash_cpu.load() is None:
        return False
    if (cfg.hidden_size % 32 if dtype == torch.bfloat16 else cfg.head_dim > 512 or cfg.head_dim % 2):
        return False
    if cfg.num_heads // cfg.num_kv_heads > flash_cpu.load().flash_max_rows():
        return False
    bf16 = dtype == torch.bfloat16
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (type(layer) is DecoderLayer and type(attn) is FusedQKVAttention and (attn.kernels or not bf16)
                and type(mlp) is FusedSwiGLU and (mlp.kernels or not bf16)
                and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm):
            return False
        if any(linear_entry(m, dtype) is None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return False
    return True


class DecodeStep:
    """Bucket b's decode step (b <= max_rows(dtype)) as one call of decode_layers_bf16 / _f32.

    `attention`: the bucket's per-layer attention objects (runner.OpAttention), whose K/V pools
    and step buffers (rows, cu, lens, tables) the plan points at."""

    def __init__(self, model: nn.Module, attention: list, b: int, block_size: int):
        cfg, layers = model.config, model.model.layers
        nh, nkv, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        dtype = model.model.embed_tokens.weight.dtype
        rows = lambda *shape: torch.empty(*shape, dtype=dtype)
        self.scratch = {"normed": rows(b, cfg.hidden_size), "qkv": rows(b, (nh + 2 * nkv) * D), "q": rows(b, nh, D),
                        "k": rows(b, nkv, D), "att": rows(b, nh, D), "proj": rows(b, cfg.hidden_size),
                        "gate_up": rows(b, 2 * inter), "act": rows(b, inter)}
        self.keep = []                                    # every tensor the plan points into
        ptr = lambda t: None if t is None else self.keep.append(t) or t.data_ptr()
        norms = lambda attn: (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)

        def linear(module: nn.Module) -> Linear:
            w, fn, tensors = linear_entry(module, dtype)
            self.keep += tensors
            return Linear(w, fn)
        self.weights = (LayerWeights * len(layers))(*[
            LayerWeights(ptr(l.input_layernorm.weight), *map(ptr, norms(l.self_attn)),
                         ptr(l.post_attention_layernorm.weight),
                         *map(linear, (l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj)),
                         ptr(a.k_cache), ptr(a.v_cache))
            for l, a in zip(layers, attention)])
        a0, lib15 = attention[0], flash_cpu.load()
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in (a0.rows, a0.cu, a0.lens, a0.tables)):
            raise ValueError("the step buffers must be contiguous int64 (GraphRunner.static)")
        qk_eps = layers[0].self_attn.q_norm.eps if layers[0].self_attn.q_norm is not None else 0.0
        self.plan = DecodePlan(
            layers=len(layers), M=b, hidden=cfg.hidden_size, nh=nh, nkv=nkv, D=D, inter=inter,
            eps=layers[0].input_layernorm.eps, qk_eps=qk_eps, scale=D ** -0.5,
            attention=ctypes.cast(lib15.flash_attention_bf16 if dtype == torch.bfloat16 else lib15.flash_attention_f32,
                                  _ptr).value,
            max_blocks=a0.tables.shape[1], block_size=block_size, q_tile=max(1, lib15.flash_max_rows() // (nh // nkv)),
            rows=ptr(a0.rows), cu=ptr(a0.cu), lens=ptr(a0.lens), tables=ptr(a0.tables),
            weights=ctypes.addressof(self.weights), **{k: ptr(t) for k, t in self.scratch.items()})
        self._call = getattr(load(), LOOPS[dtype])

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [b, hidden] in the model's dtype (the embedded tokens; overwritten), cos/sin [b, 1, D] float32 ->
        the last layer's output, in x (the final norm is the caller's)."""
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        self._call(ctypes.byref(self.plan), x.data_ptr(), cos.data_ptr(), sin.data_ptr())
        return x
