"""Flash-decoding written in torch to be read: cut the keys into splits, attend to each, merge.

One split is ordinary attention over its own keys. Besides its output it returns one number
per query row, the log-sum-exp of its scores:

    s_j   = q . k_j * scale                 for the split's keys j
    m     = max_j s_j,   l = sum_j exp(s_j - m)
    o     = sum_j exp(s_j - m) v_j / l      the split's output, as if its keys were all the keys
    lse   = m + log(l) = log sum_j exp(s_j) the split's softmax mass, in log space (no overflow)

Splits 1..S of one row merge into exactly the full attention:

    LSE   = log sum_s exp(lse_s)            the whole row's log-sum-exp
    w_s   = exp(lse_s - LSE)                split s's share of the softmax mass; sum_s w_s = 1
    out   = sum_s w_s o_s

because w_s o_s = exp(lse_s - LSE) * sum_{j in s} exp(s_j - lse_s) v_j = sum_{j in s} exp(s_j - LSE) v_j,
and summing over s gives sum_j softmax(s)_j v_j. `merge_splits` computes LSE as
M + log sum_s exp(lse_s - M) with M = max_s lse_s, the same shift that keeps softmax finite.

Same calling convention as lesson 15 (step15_flash_attention/reference.py), decodes only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from advanced.adv04_flash_decoding.splits import check_decode_inputs, resolve_split_size


def attend_split(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q [G, D], k/v [n, D] (float32): the split's output [G, D] and log-sum-exp [G]."""
    s = q @ k.T * scale                                # [G, n]: this split's scores only
    m = s.amax(-1)
    p = torch.exp(s - m[:, None])
    l = p.sum(-1)
    return (p @ v) / l[:, None], m + torch.log(l)


def merge_splits(o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """o [S, ..., D], lse [S, ...] of S splits of the same rows -> (out [..., D], LSE [...])."""
    m = lse.amax(0)                                    # the largest split mass: exp never overflows
    e = torch.exp(lse - m)                             # each split's mass relative to it
    total = e.sum(0)
    out = (e[..., None] * o).sum(0) / total[..., None]  # sum_s w_s o_s with w_s = e_s / total
    return out, m + torch.log(total)


def flash_decode_torch(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                       block_tables: Tensor, split_size: int | None = None, scale: float | None = None,
                       return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Decode attention, sequence -> KV head -> split, K/V read through the block table.

    Returns out [B, Hq, D] in q's dtype, and with `return_lse` also LSE [B, Hq] (float32).
    """
    check_decode_inputs(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                        {torch.float32, torch.bfloat16, torch.float16})
    B, Hq, D = q.shape
    num_blocks, Hkv, bs, _ = k_pool.shape
    group = Hq // Hkv
    split_size = resolve_split_size(split_size, seq_lens, Hkv, torch.get_num_threads(), bs)
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32)
    for b in range(B):
        L, table = int(seq_lens[b]), block_tables[b]
        for h in range(Hkv):
            heads = slice(h * group, (h + 1) * group)  # GQA: the query heads that share KV head h
            qh = q[b, heads].float()                   # [group, D]
            parts = []
            for start in range(0, L, split_size):      # every split starts on a block boundary
                end = min(start + split_size, L)
                blocks = table[start // bs: (end + bs - 1) // bs]
                k = k_pool[blocks, h].reshape(-1, D)[:end - start].float()   # the split's keys, in place
                v = v_pool[blocks, h].reshape(-1, D)[:end - start].float()
                parts.append(attend_split(qh, k, v, scale))                 # on a CPU/GPU: in parallel
            o_h, lse_h = merge_splits(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
            out[b, heads], lse[b, heads] = o_h.to(q.dtype), lse_h
    return (out, lse) if return_lse else out
