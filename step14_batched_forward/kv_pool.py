"""Lesson 12's pool with a head-major block layout: [num_blocks, num_kv_heads, block_size, head_dim].

Why change the layout: attention reads, for one sequence and one KV head, all its keys in a
row. In lesson 12's layout [block, slot, head, dim] those keys are spread out (one head's
128 numbers, then the other heads'), so a gather produces [B, L, Hkv, D] and attention has to
read it through a transpose. Head-major blocks hold each head's 16 keys contiguously, so a
gather of (block, head) pieces yields exactly [B, Hkv, L, D], the shape a batched matmul
wants, with no second copy.
"""
from __future__ import annotations

import torch
from torch import Tensor

from step04_transformer.config import ModelConfig
from step12_paged_attention.kv_pool import KVPool


class HeadMajorKVPool(KVPool):
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.num_blocks, self.block_size, self.num_kv_heads = num_blocks, block_size, cfg.num_kv_heads

    def head_rows(self, slot_mapping: Tensor) -> Tensor:
        """Row of (token, head) in the pool seen as [num_blocks * Hkv * block_size, D]: [T * Hkv]."""
        bs, H = self.block_size, self.num_kv_heads
        block, offset = slot_mapping // bs, slot_mapping % bs
        heads = torch.arange(H, device=slot_mapping.device)
        return ((block[:, None] * H + heads[None, :]) * bs + offset[:, None]).flatten()

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        rows = self.head_rows(slot_mapping) if rows is None else rows
        D = k.shape[-1]
        self.k[layer].view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
        self.v[layer].view(-1, D).index_copy_(0, rows, v.reshape(-1, D))

    def gather(self, layer: int, block_table: Tensor, end: int) -> tuple[Tensor, Tensor]:
        """One sequence's K/V as [end, Hkv, D] (lesson 12's interface, used by its tests)."""
        k = self.k[layer][block_table].transpose(1, 2).flatten(0, 1)[:end]
        v = self.v[layer][block_table].transpose(1, 2).flatten(0, 1)[:end]
        return k, v

    def piece_index(self, block_tables: Tensor) -> Tensor:
        """Index of each (sequence, head, block) piece in the pool seen as [num_blocks * Hkv, bs, D]."""
        H = self.num_kv_heads
        return (block_tables[:, None, :] * H + torch.arange(H, device=block_tables.device)[None, :, None]).flatten()
