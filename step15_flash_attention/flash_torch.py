"""FlashAttention written in torch to be read: tiles, a running max, a running sum, a rescale.

Plain attention computes every score of a query row before it can normalise any of them:

    S = q K^T * scale        [n, L]   <- the buffer that grows with the square of the length
    P = softmax(S)           needs max_j S_j and sum_j exp(S_j - max) over the *whole* row
    O = P V

The online softmax removes that need. Walk the keys tile by tile and keep, per query row,
m (the largest score seen so far), l (the sum of exp(score - m) so far) and acc (the sum of
exp(score - m) * v so far). When a tile brings a larger maximum m', everything accumulated
so far was scaled by exp(-m) and must now be scaled by exp(-m'), so multiply l and acc by
alpha = exp(m - m'). After the last tile, O = acc / l is exactly softmax(S) V: only one tile
of scores ever exists. Tiles wholly above the causal diagonal are skipped, not masked.

Same calling convention as `reference.py`: varlen queries, K/V read through block tables
from lesson 14's head-major pool, whole blocks per key tile, no gather of a sequence's K/V.
"""
from __future__ import annotations

import torch
from torch import Tensor


def flash_attention_torch(q: Tensor, k_pool: Tensor, v_pool: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                          block_tables: Tensor, scale: float | None = None, q_tile: int = 64,
                          kv_tile_blocks: int = 4) -> Tensor:
    T, Hq, D = q.shape
    num_blocks, Hkv, bs, _ = k_pool.shape
    group = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    kv_tile = kv_tile_blocks * bs                      # a key tile is whole blocks of the table
    out = torch.empty_like(q)
    for b in range(len(seq_lens)):
        q0, q1, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        first_pos = L - (q1 - q0)                      # position of this sequence's first query
        table = block_tables[b]
        for h in range(Hkv):
            heads = slice(h * group, (h + 1) * group)  # the query heads that share KV head h
            for i0 in range(q0, q1, q_tile):
                i1 = min(i0 + q_tile, q1)
                # GQA: the `group` heads of each query become rows of one tile, so each K/V tile is
                # read once for all of them. Row r is query i0 + r // group.
                qt = q[i0:i1, heads].reshape(-1, D).float() * scale            # [rows, D]
                row_pos = first_pos + (i0 - q0) + torch.arange(i1 - i0).repeat_interleave(group)
                m = torch.full((qt.shape[0],), float("-inf"))                  # running max
                l = torch.zeros(qt.shape[0])                                   # running sum of exp
                acc = torch.zeros(qt.shape[0], D)                              # running sum of exp * v
                last_key = first_pos + (i1 - q0) - 1                           # no row sees past it
                for j0 in range(0, last_key + 1, kv_tile):                     # tiles past it: skipped
                    j1 = min(j0 + kv_tile, last_key + 1)
                    blocks = table[j0 // bs: (j1 + bs - 1) // bs]              # block table -> pool
                    kt = k_pool[blocks, h].reshape(-1, D)[:j1 - j0].float()    # [keys, D], in place
                    vt = v_pool[blocks, h].reshape(-1, D)[:j1 - j0].float()
                    s = qt @ kt.T                                              # [rows, keys]: one tile
                    if j1 - 1 > row_pos[0]:                                    # tile crosses the diagonal
                        s.masked_fill_(torch.arange(j0, j1)[None, :] > row_pos[:, None], float("-inf"))
                    m_new = torch.maximum(m, s.amax(-1))
                    alpha = torch.exp(m - m_new)                               # rescale the past
                    p = torch.exp(s - m_new[:, None])
                    l = alpha * l + p.sum(-1)
                    acc = alpha[:, None] * acc + p @ vt
                    m = m_new
                out[i0:i1, heads] = (acc / l[:, None]).view(i1 - i0, group, D).to(q.dtype)
    return out
