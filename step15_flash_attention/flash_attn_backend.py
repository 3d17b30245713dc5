"""flash-attn 2 on CUDA: the kernels vLLM and nano-vllm call, fed the same varlen metadata.

flash-attn reads a paged cache laid out token-major, [num_blocks, block_size, Hkv, D], which
is lesson 12's `KVPool` layout, so this backend asks the engine for that pool instead of the
head-major one. Upstream flash-attn 2 refuses paged caches whose block size is not a multiple
of 256 ("Paged KV cache block size must be divisible by 256", a TORCH_CHECK in its
`mha_varlen_fwd` and `mha_fwd_kvcache`); nano-vllm uses 256 for this reason, vLLM ships its
own fork that accepts 16. The backend declares the constraint and the engine follows it.

Both entry points use causal masks aligned to the bottom right when there are fewer queries
than keys, which is this lesson's convention (a chunk's queries are the sequence's last tokens).
Not run on this machine (no GPU); see the README for what was and was not measured.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor


@lru_cache(maxsize=None)
def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_attn_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                     block_tables: Tensor, scale: float | None = None, check: bool = True) -> Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    if check:
        if not q.is_cuda or k_cache.dtype != q.dtype or v_cache.shape != k_cache.shape:
            raise ValueError("flash-attn needs CUDA tensors of one dtype and K/V caches of one shape")
        if k_cache.shape[1] % 256:
            raise ValueError(f"flash-attn 2 needs a paged block size that is a multiple of 256, got {k_cache.shape[1]}")
    dev = q.device
    tables = block_tables.to(dev, torch.int32, non_blocking=True)
    lens = seq_lens.to(dev, torch.int32, non_blocking=True)
    q_lens = cu_seqlens_q.diff()
    if int(q_lens.max()) == 1:        # decodes only: the kernel built for one new token per sequence
        out = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=lens, block_table=tables,
                                      softmax_scale=scale, causal=True)
        return out[:, 0]
    cu_k = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(seq_lens, 0, out=cu_k[1:])
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q.to(dev, torch.int32),
                                  cu_seqlens_k=cu_k.to(dev), max_seqlen_q=int(q_lens.max()),
                                  max_seqlen_k=int(seq_lens.max()), softmax_scale=scale, causal=True,
                                  block_table=tables)
