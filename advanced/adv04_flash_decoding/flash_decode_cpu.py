"""Build `flash_decode.cpp` with lesson 14's builder and call it through ctypes.

The C++ file includes lesson 15's `flash_attention.cpp` (for `fast_exp`), which includes lesson
14's `paged_decode.cpp` (bf16 conversion, dot product, axpy, prefetch): both folders are on the
include path and in the cache key, so editing either lesson's kernel rebuilds this one too.
`MINIVLLM_KERNEL=0` or a missing compiler makes `load()` return None.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from advanced.adv04_flash_decoding.splits import check_decode_inputs, resolve_split_size
from step14_batched_forward import kernel as lesson14_kernel
from step15_flash_attention import flash_cpu as lesson15_kernel

SOURCE = Path(__file__).with_name("flash_decode.cpp")
INCLUDE_DIRS = (lesson15_kernel.SOURCE.parent, lesson14_kernel.SOURCE.parent)
_FUNCS = {torch.bfloat16: "flash_decode_bf16", torch.float32: "flash_decode_f32"}


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    lib = lesson14_kernel.build_or_warn(SOURCE, "flash-decoding kernel unavailable", INCLUDE_DIRS)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float, i64]
        fn.restype = None
    lib.paged_decode_max_group.restype = i64    # lesson 14's limit, compiled into this library too
    return lib


def flash_decode_cpu(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                     block_tables: Tensor, split_size: int | None = None, scale: float | None = None,
                     return_lse: bool = False, check: bool = True) -> Tensor | tuple[Tensor, Tensor]:
    """Split-KV decode attention (lesson 15's convention, one query per sequence).

    `split_size` (keys, a multiple of the block size) defaults to the rule in splits.py for
    torch's thread count. With `return_lse` also returns each row's log-sum-exp [B, Hq] float32.
    `check=False` skips the input checks, for a caller that ran them on the same metadata.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the flash-decoding kernel is not available (see the warning above)")
    if check:
        check_decode_inputs(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, set(_FUNCS))
        group = q.shape[1] // k_pool.shape[1]
        if group > lib.paged_decode_max_group():
            raise ValueError(f"the kernel supports up to {lib.paged_decode_max_group()} query heads per KV head, "
                             f"got {group}")
    B, Hq, D = q.shape
    num_blocks, Hkv, bs, _ = k_pool.shape
    split_size = resolve_split_size(split_size, seq_lens, Hkv, torch.get_num_threads(), bs)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32) if return_lse else None
    if B:
        q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
        lens, tables = seq_lens.contiguous(), block_tables.contiguous()
        getattr(lib, _FUNCS[q.dtype])(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), lens.data_ptr(),
                                      tables.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(),
                                      B, tables.shape[1], Hkv, Hq // Hkv, bs, D,
                                      D ** -0.5 if scale is None else scale, split_size)
    return (out, lse) if return_lse else out
