"""Build `flash_attention.cpp` (with lesson 14's builder) and call it through ctypes.

The C++ file includes lesson 14's `paged_decode.cpp` for its row loops (bf16 conversion,
dot product, axpy, prefetch), so lesson 14's folder is on its include path and in the cache
key. `MINIVLLM_KERNEL=0` or a missing compiler makes `load()` return None; the engine then
falls back to lesson 15's torch path (see attention.py).

bf16 prompt tiles have two implementations (flash_attention.cpp's header): float32 FMAs on
widened tiles, or bf16 dot products where the build has AVX512-BF16. `prefill_tiles()` picks
one: MINIVLLM_PREFILL_TILES=bf16 or f32 forces it; auto (the default) takes the dot products
where one core's measured dot-product rate (peak.cpp) clearly beats its FMA rate.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from step14_batched_forward import kernel as lesson14_kernel

SOURCE = Path(__file__).with_name("flash_attention.cpp")
MAX_BLOCK_SIZE = 1024          # kMaxKeyTile in the C++ file
_FUNCS = {torch.bfloat16: "flash_attention_bf16", torch.float32: "flash_attention_f32"}
TILES_VAR = "MINIVLLM_PREFILL_TILES"
_TILE_MODES = {"f32": 0, "bf16": 1, "bf16-scores": 2}   # flash_set_prefill_tiles; bf16-scores: measuring only
# auto takes the dot products only where they do this much more arithmetic per second than FMAs:
# at equal rates the FMAs win, since the dot products round P to bf16 and shuffle V.
DOT_MARGIN = 1.25


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    lib = lesson14_kernel.build_or_warn(SOURCE, "flash attention kernel unavailable, using the torch path",
                                        (lesson14_kernel.SOURCE.parent,))
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float, i64]
        fn.restype = None
    lib.flash_max_rows.restype = lib.flash_prefill_bf16_built.restype = i64
    lib.flash_set_prefill_tiles.argtypes, lib.flash_set_prefill_tiles.restype = [i64], None
    return lib


def core_peaks(iters: int = 20_000_000) -> tuple[float, float]:
    """GFLOP/s of one core: float32 FMAs and bf16 dot products (-1: no AVX512-BF16), from peak.cpp."""
    lib = _peak_lib()
    return lib.peak_fp32_fma_gflops(iters), lib.peak_bf16_dot_gflops(iters)


@lru_cache(maxsize=None)
def _peak_lib() -> ctypes.CDLL:
    lib = lesson14_kernel.build_library(SOURCE.with_name("peak.cpp"), (lesson14_kernel.SOURCE.parent,))   # + isa.h
    for name in ("peak_fp32_fma_gflops", "peak_bf16_dot_gflops"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_double, [ctypes.c_int64]
    return lib


@lru_cache(maxsize=None)
def dot_beats_fma() -> bool:
    """Measured once a process (about 20 ms): do bf16 dot products beat float32 FMAs on this core?
    Best of three alternating short runs each, so a moment of other work on the core counts less."""
    runs = [core_peaks(1_000_000) for _ in range(3)]
    fma, dot = max(r[0] for r in runs), max(r[1] for r in runs)
    return dot > DOT_MARGIN * fma


def prefill_tiles() -> str:
    """'bf16' or 'f32': what bf16 prompt tiles use in this process (MINIVLLM_PREFILL_TILES, see above)."""
    lib = load()
    choice = os.environ.get(TILES_VAR, "auto")
    if choice not in (*_TILE_MODES, "auto"):
        raise ValueError(f"{TILES_VAR} must be auto, bf16 or f32, got {choice!r}")
    if lib is None or not lib.flash_prefill_bf16_built():
        if choice.startswith("bf16"):
            _warn_once(f"{TILES_VAR}={choice}: this build has no AVX512-BF16, using float32 tiles")
        return "f32"
    if choice == "auto":
        return "bf16" if dot_beats_fma() else "f32"
    return choice


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message)


_applied: list[int] = [-1]      # the mode the library holds, so a call sets it only when it changes


def _apply_tiles(lib: ctypes.CDLL) -> None:
    mode = _TILE_MODES[prefill_tiles()]
    if mode != _applied[0]:
        lib.flash_set_prefill_tiles(mode)
        _applied[0] = mode


def flash_attention_cpu(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                        block_tables: Tensor, scale: float | None = None, out: Tensor | None = None,
                        check: bool = True) -> Tensor:
    """Paged varlen attention for a whole mixed batch (reference.py has the convention).

    `check=False` skips the input checks, for a caller that ran them already on the same
    metadata and pool shapes (the engine checks once per step, at layer 0).
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the flash attention kernel is not available (see the warning above)")
    if check:
        check_inputs(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, set(_FUNCS))
        if q.shape[1] // k_pool.shape[1] > lib.flash_max_rows() or k_pool.shape[2] > MAX_BLOCK_SIZE:
            raise ValueError(f"the kernel supports up to {lib.flash_max_rows()} query heads per KV head and "
                             f"blocks of up to {MAX_BLOCK_SIZE} tokens, got {q.shape[1] // k_pool.shape[1]} "
                             f"and {k_pool.shape[2]}")
    T, Hq, D = q.shape
    num_blocks, Hkv, bs, _ = k_pool.shape
    group = Hq // Hkv
    q_tile = max(1, lib.flash_max_rows() // group)       # q_tile * group rows fill one tile
    out = torch.empty_like(q) if out is None else out
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    cu, lens, tables = cu_seqlens_q.contiguous(), seq_lens.contiguous(), block_tables.contiguous()
    if q.dtype == torch.bfloat16:
        _apply_tiles(lib)
    getattr(lib, _FUNCS[q.dtype])(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), cu.data_ptr(),
                                  lens.data_ptr(), tables.data_ptr(), out.data_ptr(), len(lens),
                                  tables.shape[1], Hkv, group, bs, D, D ** -0.5 if scale is None else scale, q_tile)
    return out


def check_inputs(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                 block_tables: Tensor, dtypes: set[torch.dtype]) -> None:
    """Everything a kernel trusts: a wrong size there reads outside the pool instead of raising."""
    if q.dim() != 3 or k_pool.dim() != 4:
        raise ValueError(f"q must be [T, Hq, D] and the pools [num_blocks, Hkv, block_size, D], "
                         f"got {tuple(q.shape)} and {tuple(k_pool.shape)}")
    T, Hq, D = q.shape
    num_blocks, Hkv, bs, Dk = k_pool.shape
    if q.dtype not in dtypes or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"q/k/v must share one dtype among {sorted(map(str, dtypes))}, "
                        f"got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if v_pool.shape != k_pool.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, "
                         f"v_pool {tuple(v_pool.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
    B = seq_lens.shape[0]
    if seq_lens.dim() != 1 or cu_seqlens_q.shape != (B + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, seq_lens {tuple(seq_lens.shape)} and "
                         f"block_tables {tuple(block_tables.shape)} do not describe one batch")
    if B == 0:
        return
    q_lens = cu_seqlens_q.diff()
    if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != T or int(q_lens.min()) < 1:
        raise ValueError(f"cu_seqlens_q must rise from 0 to T={T} by at least 1 per sequence")
    if bool((q_lens > seq_lens).any()):
        raise ValueError("a sequence has more queries than keys (cu_seqlens_q step > seq_lens)")
    capacity = block_tables.shape[1] * bs
    if int(seq_lens.max()) > capacity:
        raise ValueError(f"seq_lens must be <= {capacity}, the block tables' capacity "
                         f"({block_tables.shape[1]} blocks of {bs})")
    slots = torch.arange(block_tables.shape[1], device=block_tables.device)   # the tables' device: CUDA on a GPU
    used = slots[None, :] < ((seq_lens + bs - 1) // bs)[:, None]
    ids = block_tables[used]                     # only the blocks the kernel will read
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables hold ids outside the pool's {num_blocks} blocks")
