"""The yardstick every lesson-15 kernel is tested against: plain attention in float32.

The calling convention is the one all of this lesson's kernels share (flash-attn's "varlen"
convention, with K/V in lesson 14's head-major paged pool):

    q             [T, Hq, D]      the new tokens of B sequences, laid end to end
    k_pool/v_pool [num_blocks, Hkv, block_size, D]   one layer's pool, this step's K/V already written
    cu_seqlens_q  [B + 1] int64   sequence b's queries are q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]
    seq_lens      [B] int64       keys sequence b attends to: positions 0 .. seq_lens[b] - 1
    block_tables  [B, max_blocks] int64  where those keys live in the pool

Sequence b's queries are its *last* n_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] tokens, so query i
sits at position seq_lens[b] - n_b + i and sees keys 0 .. that position (causal). A decode is
n_b = 1; a first prompt chunk is n_b = seq_lens[b]; a later chunk or a prefix-cache hit has
n_b < seq_lens[b] (prior context in the pool). Query head h uses KV head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch
from torch import Tensor


def gather_kv(pool: Tensor, table: Tensor, length: int) -> Tensor:
    """One sequence's keys (or values) out of a head-major pool: [length, Hkv, D]."""
    return pool[table].transpose(1, 2).flatten(0, 1)[:length]


def reference_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                        block_tables: Tensor, scale: float | None = None) -> Tensor:
    """Sequence by sequence: gather K/V, build the full causal mask, softmax in float32. Returns float32."""
    T, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(T, Hq, D, dtype=torch.float32)
    for b in range(len(seq_lens)):
        q0, q1, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        n = q1 - q0
        k = gather_kv(k_pool, block_tables[b], L).float().repeat_interleave(Hq // Hkv, 1)   # [L, Hq, D]
        v = gather_kv(v_pool, block_tables[b], L).float().repeat_interleave(Hq // Hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale                # [Hq, n, L]
        q_pos = torch.arange(L - n, L)
        visible = torch.arange(L)[None, :] <= q_pos[:, None]                             # [n, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def random_paged_case(q_lens: list[int], seq_lens: list[int], Hkv: int, group: int, block_size: int, D: int,
                      dtype: torch.dtype = torch.float32, seed: int = 0, spare_blocks: int = 3):
    """A random varlen batch over a shuffled pool: (q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables)."""
    assert all(0 < n <= L for n, L in zip(q_lens, seq_lens)), "each sequence needs 1 <= q_len <= seq_len"
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-L // block_size) for L in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + spare_blocks
    k_pool = torch.randn(num_blocks, Hkv, block_size, D, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, Hkv, block_size, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = (2 * torch.randn(sum(q_lens), Hkv * group, D, generator=g)).to(dtype)
    cu = torch.tensor([0] + q_lens).cumsum(0)
    return q, k_pool, v_pool, cu, torch.tensor(seq_lens), tables
