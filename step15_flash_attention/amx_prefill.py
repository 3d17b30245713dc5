"""Prompt attention on AMX tiles: the same tiled online softmax as flash_attention.cpp, with
each tile's two matmuls (Q K^T and P V) done by the CPU's matrix unit (amx_prefill.cpp).

Where the CPU has AMX (Xeon Sapphire Rapids and later) and the step is bf16, the prompt rows of a
step can go here in one call; everywhere else `amx_library()` is None and the caller keeps
flash_attention.cpp (decodes) or torch's SDPA (prompt chunks). Lesson 16's fast path calls it
from its attention op (`step16_cuda_graph/cpu/ops.py`, `prompts_apart`).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from step14_batched_forward import kernel as lesson14_kernel

AMX_SOURCE = Path(__file__).with_name("amx_prefill.cpp")
LESSON14_DIR = Path(lesson14_kernel.__file__).parent      # isa.h


@lru_cache(maxsize=None)
def amx_library() -> ctypes.CDLL | None:
    """amx_prefill.cpp built for this CPU, or None where it has no AMX tiles (or no compiler,
    or MINIVLLM_KERNEL=0)."""
    lib = lesson14_kernel.build_or_warn(AMX_SOURCE, "AMX prompt attention unavailable, using torch's SDPA",
                                        (LESSON14_DIR,))
    if lib is None:
        return None
    lib.amx_prefill_available.restype = ctypes.c_int64
    if not lib.amx_prefill_available():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_prefill_bf16.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float]
    lib.amx_prefill_bf16.restype = ctypes.c_int64
    return lib


def amx_prefill_fits(q: Tensor, k_cache: Tensor) -> bool:
    """bf16, head_dim a multiple of 32 up to 256, at most 32 query heads per KV head, AMX here."""
    group, D = q.shape[1] // k_cache.shape[1], q.shape[2]
    return (q.dtype == torch.bfloat16 and D % 32 == 0 and D <= 256 and group <= 32
            and amx_library() is not None)


def amx_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                block_tables: Tensor, out: Tensor) -> None:
    """Rows of `out` of every sequence with more than one query row (metadata checked by the caller)."""
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    q = q.contiguous()
    num_blocks, Hkv, bs, D = k_cache.shape
    cu, lens, tables = cu_seqlens_q.contiguous(), seq_lens.contiguous(), block_tables.contiguous()
    status = amx_library().amx_prefill_bf16(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cu.data_ptr(),
                                            lens.data_ptr(), tables.data_ptr(), out.data_ptr(), len(lens),
                                            tables.shape[1], Hkv, q.shape[1] // Hkv, bs, D, D ** -0.5)
    if status != 0:
        raise MemoryError("amx_prefill: no memory for the step's packed keys and values")
