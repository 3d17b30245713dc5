"""The same paged FlashAttention in Triton: the GPU path, and on a CPU a check in the interpreter.

A Triton *program* is one tile of work; the GPU runs thousands of them at once. The mapping
from `flash_torch.py` is direct:

    torch loop                          Triton
    for b, for h, for query tile   ->   the grid: program (b, h, tile) = tl.program_id(0, 1, 2)
    k_pool[blocks, h] (block ids)  ->   block ids loaded from the table, row pointers computed:
                                        ((block * Hkv + kv_head) * block_size + offset) * D
    qt @ kt.T, p @ vt              ->   tl.dot on [BLOCK_M, D] x [D, BLOCK_N] tiles (tensor cores)
    m, l, acc, alpha               ->   the same running state, in registers

Two kernels, as engines have: `_prefill` for sequences with several new queries (a prompt,
a chunk after prior context, a prefix-cache hit), one program per query tile; `_decode` for
one new query, one program per (sequence, query head), a vector against each key tile (a
1-row tl.dot would waste a tensor core). Both read lesson 14's head-major pool in place.

Without a GPU, `TRITON_INTERPRET=1` (set before this module is imported) runs the programs
one by one in numpy: far too slow to serve, exact enough to test (tests/test_step15_triton.py).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:            # triton is in the test extra; the CPU engine does not need it
    triton = None


def triton_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def default_tiles(device: torch.device) -> tuple[int, int, int]:
    """(decode key tile, prefill query tile, prefill key tile) for the kernels on `device`.

    Compiled on CUDA: a decode program's grid is (sequence, query head) whatever its key tile,
    so a wider tile costs no programs and gives each loop step more K/V bytes in flight (the
    walk is latency-bound with 16 keys). A prefill query tile is a trade: 64 rows make 4x fewer
    programs than 16 (4 prompts of 1024 tokens, 16 heads: 1024, still ~8 per SM on 132) but
    read each K/V tile once per 64 queries instead of 16, on tensor-core-sized dots; 128 x 64
    gave too few, heavier programs. Measured on one H200 on 2026-12-04 (advanced/adv04's
    bench_gpu.py, Qwen3-0.6B shape, bf16): 64 decodes of 1000 keys 0.391 -> 0.231 ms, one of
    32k keys 4.09 -> 2.62 ms, 4 x 1024-token prompts 0.336 ms (16 x 16) -> 0.134 ms (64 x 32;
    128 x 64: 0.162). In the interpreter (TRITON_INTERPRET=1, CPU tests) numpy runs each
    program in turn and masked rows and keys are work too: small tiles keep the tests quick.
    Any tile works with any block size: each key finds its block through the table.
    """
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return 64, 64, 32
    return 16, 16, 16


if triton is not None:
    @triton.jit
    def _prefill(Q, K, V, O, CU, LENS, TABLES, scale, max_blocks,
                 HQ: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        b, h, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q0 = tl.load(CU + b)
        n = tl.load(CU + b + 1) - q0
        if n > 1 and tile * BLOCK_M < n:                # decodes go to _decode; idle tiles exit
            first_pos = tl.load(LENS + b) - n           # position of this sequence's first query
            kv_head = h // (HQ // HKV)
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, D)
            row_ok = offs_m < n
            q = tl.load(Q + ((q0 + offs_m) * HQ + h)[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            pos = first_pos + offs_m                    # padded rows see every key: no empty row, no NaN
            last_key = first_pos + tl.minimum(tile * BLOCK_M + BLOCK_M, n) - 1
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            for start in range(0, last_key + 1, BLOCK_N):   # key tiles past the tile's last query: skipped
                offs_n = start + tl.arange(0, BLOCK_N)
                key_ok = offs_n <= last_key
                block = tl.load(TABLES + b * max_blocks + offs_n // BS, mask=key_ok, other=0)
                rows = ((block * HKV + kv_head) * BS + offs_n % BS)[:, None] * D + offs_d[None, :]
                k = tl.load(K + rows, mask=key_ok[:, None], other=0.0)
                if DOT_F32:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                s = tl.where((offs_n[None, :] <= pos[:, None]) & key_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)             # rescale what was summed under the old max
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + rows, mask=key_ok[:, None], other=0.0)
                if DOT_F32:
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(O + ((q0 + offs_m) * HQ + h)[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty),
                     mask=row_ok[:, None])

    @triton.jit
    def _decode(Q, K, V, O, CU, LENS, TABLES, scale, max_blocks,
                HQ: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        row = tl.load(CU + b)
        if tl.load(CU + b + 1) - row == 1:
            length = tl.load(LENS + b)
            kv_head = h // (HQ // HKV)
            offs_d = tl.arange(0, D)
            q = tl.load(Q + (row * HQ + h) * D + offs_d).to(tl.float32)
            m_i = float("-inf")
            l_i = 0.0
            acc = tl.zeros([D], tl.float32)
            for start in range(0, length, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                key_ok = offs_n < length
                block = tl.load(TABLES + b * max_blocks + offs_n // BS, mask=key_ok, other=0)
                rows = ((block * HKV + kv_head) * BS + offs_n % BS)[:, None] * D + offs_d[None, :]
                k = tl.load(K + rows, mask=key_ok[:, None], other=0.0).to(tl.float32)
                s = tl.where(key_ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 0))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new)
                l_i = l_i * alpha + tl.sum(p, 0)
                v = tl.load(V + rows, mask=key_ok[:, None], other=0.0).to(tl.float32)
                acc = acc * alpha + tl.sum(p[:, None] * v, 0)
                m_i = m_new
            tl.store(O + (row * HQ + h) * D + offs_d, (acc / l_i).to(O.dtype.element_ty))


def flash_attention_triton(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                           block_tables: Tensor, scale: float | None = None, check: bool = True,
                           block_m: int | None = None, block_n: int | None = None) -> Tensor:
    """Paged varlen attention (reference.py's convention): decodes through `_decode`, the rest through `_prefill`.

    Tiles left as None come from `default_tiles(q.device)`; `block_n` given sets both kernels' key tile.
    """
    from step15_flash_attention.flash_cpu import check_inputs
    if not triton_available():
        raise RuntimeError("Triton needs a CUDA GPU here, or TRITON_INTERPRET=1 set before import to run on a CPU")
    T, Hq, D = q.shape
    if check:
        check_inputs(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                     {torch.float32, torch.bfloat16, torch.float16})
        if D < 16 or D & (D - 1):
            raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16 (tl.arange), got {D}")
    num_blocks, Hkv, bs, _ = k_pool.shape
    B = len(seq_lens)
    out = torch.empty_like(q)
    if B == 0:
        return out
    scale = D ** -0.5 if scale is None else scale
    decode_n, prefill_m, prefill_n = default_tiles(q.device)
    decode_n, prefill_n = (decode_n, prefill_n) if block_n is None else (block_n, block_n)
    block_m = prefill_m if block_m is None else block_m
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    cu, lens, tables = cu_seqlens_q.contiguous(), seq_lens.contiguous(), block_tables.contiguous()
    args = (q, k_pool, v_pool, out, cu, lens, tables, scale, tables.shape[1])
    if B == T:
        # One query per sequence (each has at least one): decodes only, known from the shapes
        # alone, so nothing is read back from the GPU (a CUDA graph capture forbids that).
        _decode[(B, Hq)](*args, HQ=Hq, HKV=Hkv, BS=bs, D=D, BLOCK_N=decode_n)
        return out
    q_lens = cu_seqlens_q.diff()
    if bool((q_lens == 1).any()):
        _decode[(B, Hq)](*args, HQ=Hq, HKV=Hkv, BS=bs, D=D, BLOCK_N=decode_n)
    longest = int(q_lens.max())
    if longest > 1:
        precision = "ieee" if q.dtype == torch.float32 else "tf32"   # fp32: no TF32 shortcut on the GPU
        # The interpreter (triton 3.9) multiplies bf16 tiles wrongly in tl.dot, so on a CPU the tiles
        # are widened to float32 first; on a GPU bf16 tiles go to the tensor cores as they are.
        _prefill[(B, Hq, triton.cdiv(longest, block_m))](*args, HQ=Hq, HKV=Hkv, BS=bs, D=D, BLOCK_M=block_m,
                                                         BLOCK_N=prefill_n, PRECISION=precision,
                                                         DOT_F32=q.device.type == "cpu")
    return out
