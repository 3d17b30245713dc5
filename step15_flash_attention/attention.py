"""One attention call per layer for the whole mixed batch: decodes and prompt chunks together.

Lesson 14 split each step into two calls: decodes through its paged kernel, prompt chunks
through a gather of their K/V and SDPA with an explicit [chunk, L] mask. Here a step's
metadata is flash-attn's varlen description of the batch, built once per step:

    slot_mapping   where each new token's K/V is written (as in lessons 12-14)
    cu_seqlens_q   [B + 1]  query offsets: sequence b owns rows cu[b] .. cu[b+1]-1
    seq_lens       [B]      keys each sequence sees after this step's write
    block_tables   [B, max_blocks]

and every layer does: write K/V, then `backend.kernel(q, k_pool, v_pool, cu, lens, tables)`.
Which kernel, and which pool layout it reads, is the backend's choice (backends.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from step09_continuous_batching.scheduler import ScheduledBatch
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step15_flash_attention.backends import AttentionBackend


class FlashPagedAttention:
    def __init__(self, pool, batch: ScheduledBatch, backend: AttentionBackend):
        self.pool, self.kernel = pool, backend.kernel
        bs = pool.block_size
        B = len(batch.seqs)
        starts = torch.tensor([s.num_computed_tokens for s in batch.seqs])
        q_lens = torch.tensor(batch.num_tokens)
        self.seq_lens = starts + q_lens
        self.cu_seqlens_q = torch.zeros(B + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=self.cu_seqlens_q[1:])
        self.block_tables = torch.zeros(B, max(len(s.block_table) for s in batch.seqs), dtype=torch.long)
        for i, s in enumerate(batch.seqs):
            self.block_tables[i, :len(s.block_table)] = torch.tensor(s.block_table)
        # Slot of every new token: its position's block in its own table, then the offset in it.
        seq_of_row = torch.repeat_interleave(torch.arange(B), q_lens)
        pos = starts[seq_of_row] + torch.arange(int(q_lens.sum())) - self.cu_seqlens_q[seq_of_row]
        self.slot_mapping = self.block_tables[seq_of_row, pos // bs] * bs + pos % bs
        # Built on the host from Python lists, then one copy each to where the pool and the
        # kernel are (on a CPU, .to returns the same tensor: no copy).
        device = pool.k[0].device
        self.cu_seqlens_q, self.seq_lens = self.cu_seqlens_q.to(device), self.seq_lens.to(device)
        self.block_tables, self.slot_mapping = self.block_tables.to(device), self.slot_mapping.to(device)
        # Head-major pools write (token, head) rows; computed once, used by every layer.
        self.rows = pool.head_rows(self.slot_mapping) if isinstance(pool, HeadMajorKVPool) else None

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pool = self.pool
        if self.rows is not None:
            pool.write(layer_idx, self.slot_mapping, k, v, self.rows)
        else:
            pool.write(layer_idx, self.slot_mapping, k, v)
        # The metadata is the same for every layer, so the kernel checks it at layer 0 only.
        return self.kernel(q, pool.k[layer_idx], pool.v[layer_idx], self.cu_seqlens_q, self.seq_lens,
                           self.block_tables, check=layer_idx == 0)
