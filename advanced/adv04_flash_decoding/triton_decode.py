"""Flash-decoding in Triton: a split pass and a reduce pass, on lesson 15's paged pool.

Lesson 15's `_decode` runs one program per (sequence, query head), each walking the whole
context. At batch 1 with 16 query heads that is 16 programs, on a GPU with 132 SMs: 116 SMs
idle while 16 walk 32k keys each. Here the grid gets a third axis:

    _split_pass   grid (B, Hq, max_splits)   program (b, h, s) attends to keys
                                             [s * split_size, (s + 1) * split_size) of sequence b
                                             (through the block table, as lesson 15) and writes
                                             o_part [D] float32 and lse_part (one float)
    _reduce_pass  grid (B, Hq)               merges sequence b's ceil(len / split_size) splits

Programs whose split starts past their sequence's length (shorter sequences in a mixed batch)
exit at once; the reduce pass only reads the splits that exist. The merge is written the
online way, one split at a time: it is lesson 15's rescale rule again, applied to splits
instead of keys (running max M, running mass W, alpha = exp(M_old - M_new)).

Without a GPU, `TRITON_INTERPRET=1` (set before this module is imported) runs the programs one
by one in numpy: far too slow to serve, exact enough to test (tests/test_adv04_flash_decoding.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from advanced.adv04_flash_decoding.splits import check_decode_inputs, resolve_split_size
from step15_flash_attention.triton_attention import default_tiles, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:            # triton is in the test extra; the CPU kernel does not need it
    triton = None


if triton is not None:
    @triton.jit
    def _split_pass(Q, K, V, O_PART, LSE_PART, LENS, TABLES, scale, max_blocks, split_size, max_splits,
                    HQ: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(LENS + b)
        start = split * split_size
        if start < length:                              # this sequence has a split number `split`
            end = tl.minimum(start + split_size, length)
            kv_head = h // (HQ // HKV)
            offs_d = tl.arange(0, D)
            q = tl.load(Q + (b * HQ + h) * D + offs_d).to(tl.float32)
            m_i = float("-inf")
            l_i = 0.0
            acc = tl.zeros([D], tl.float32)
            for key0 in range(start, end, BLOCK_N):     # lesson 15's decode loop, on this split only
                offs_n = key0 + tl.arange(0, BLOCK_N)
                key_ok = offs_n < end
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
            slot = (b * HQ + h) * max_splits + split
            tl.store(O_PART + slot * D + offs_d, acc / l_i)        # normalised within the split
            tl.store(LSE_PART + slot, m_i + tl.log(l_i))           # the split's softmax mass, in logs

    @triton.jit
    def _reduce_pass(O_PART, LSE_PART, O, LSE, LENS, split_size, max_splits,
                     HQ: tl.constexpr, D: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        n = tl.cdiv(tl.load(LENS + b), split_size)     # the splits this sequence has
        offs_d = tl.arange(0, D)
        base = (b * HQ + h) * max_splits
        m = float("-inf")                               # largest lse so far
        w = 0.0                                         # sum of exp(lse_s - m) so far
        acc = tl.zeros([D], tl.float32)                 # sum of exp(lse_s - m) * o_s so far
        for s in range(0, n):
            lse = tl.load(LSE_PART + base + s)
            o = tl.load(O_PART + (base + s) * D + offs_d)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)                   # rescale the splits already merged
            e = tl.exp(lse - m_new)
            w = w * alpha + e
            acc = acc * alpha + e * o
            m = m_new
        tl.store(O + (b * HQ + h) * D + offs_d, (acc / w).to(O.dtype.element_ty))
        tl.store(LSE + b * HQ + h, m + tl.log(w))


def flash_decode_triton(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                        block_tables: Tensor, split_size: int | None = None, scale: float | None = None,
                        return_lse: bool = False, check: bool = True,
                        block_n: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Split-KV decode attention: `_split_pass` then `_reduce_pass` (lesson 15's convention, decodes only).

    `split_size` defaults to the rule in splits.py with one item per query head and the GPU's
    SMs as workers (on a CPU, in the interpreter: torch's threads). `block_n`, the key tile,
    defaults to lesson 15's decode tile for the device (`default_tiles`): 64 keys compiled on
    CUDA (grid (B, Hq, splits) whatever the tile; on an H200 on 2026-12-04, 33 splits of a 32k
    context 0.234 -> 0.104 ms, 64 x 1000 keys 0.385 -> 0.196 ms), 16 in the interpreter.
    """
    if not triton_available():
        raise RuntimeError("Triton needs a CUDA GPU here, or TRITON_INTERPRET=1 set before import to run on a CPU")
    B, Hq, D = q.shape
    if check:
        check_decode_inputs(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                            {torch.float32, torch.bfloat16, torch.float16})
        if D < 16 or D & (D - 1):
            raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16 (tl.arange), got {D}")
    num_blocks, Hkv, bs, _ = k_pool.shape
    block_n = default_tiles(q.device)[0] if block_n is None else block_n
    workers = (torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda
               else torch.get_num_threads())
    split_size = resolve_split_size(split_size, seq_lens.cpu(), Hq, workers, bs)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if B:
        max_splits = triton.cdiv(int(seq_lens.max()), split_size)
        o_part = torch.empty(B, Hq, max_splits, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, Hq, max_splits, dtype=torch.float32, device=q.device)
        q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
        lens, tables = seq_lens.contiguous(), block_tables.contiguous()
        _split_pass[(B, Hq, max_splits)](q, k_pool, v_pool, o_part, lse_part, lens, tables,
                                         D ** -0.5 if scale is None else scale, tables.shape[1], split_size,
                                         max_splits, HQ=Hq, HKV=Hkv, BS=bs, D=D, BLOCK_N=block_n)
        _reduce_pass[(B, Hq)](o_part, lse_part, out, lse, lens, split_size, max_splits, HQ=Hq, D=D)
    return (out, lse) if return_lse else out
