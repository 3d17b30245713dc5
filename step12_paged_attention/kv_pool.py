"""One physical KV pool per layer, sized from a memory budget, and attention that reads it
through block tables (still one sequence at a time; lesson 14 removes that loop)."""
from __future__ import annotations

import torch
from torch import Tensor

from step03_attention.attention import attention
from step04_transformer.config import ModelConfig
from step09_continuous_batching.scheduler import ScheduledBatch


class KVPool:
    """Per layer K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        # On the model's device: attention reads the pool there, every layer of every step.
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    @classmethod
    def from_memory_budget(cls, cfg: ModelConfig, kv_cache_bytes: int, block_size: int,
                           dtype: torch.dtype, device: torch.device | str = "cpu") -> "KVPool":
        """vLLM sizes its pool from gpu_memory_utilization; here the budget is given in bytes."""
        num_blocks = kv_cache_bytes // cls.bytes_per_block(cfg, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is less than one block "
                             f"({cls.bytes_per_block(cfg, block_size, dtype)} bytes)")
        return cls(cfg, int(num_blocks), block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        """Scatter the new tokens' K/V into their slots, all sequences at once."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, block_table: Tensor, end: int) -> tuple[Tensor, Tensor]:
        """One sequence's first `end` tokens of K/V, collected from its blocks (a copy)."""
        k = self.k[layer][block_table].flatten(0, 1)[:end]
        v = self.v[layer][block_table].flatten(0, 1)[:end]
        return k, v


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class PagedAttention:
    """Backend: write new K/V through the slot mapping, attend each sequence through its table."""

    def __init__(self, pool: KVPool, batch: ScheduledBatch):
        self.pool = pool
        slots, self.segments = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            slots += slot_mapping(seq.block_table, start, start + n, pool.block_size)
            self.segments.append((torch.tensor(seq.block_table), start, n))
        self.slot_mapping = torch.tensor(slots, dtype=torch.long)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.pool.write(layer_idx, self.slot_mapping, k, v)
        outs, off = [], 0
        for table, start, n in self.segments:
            keys, values = self.pool.gather(layer_idx, table, start + n)
            o = attention(q[off:off + n].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                          values.transpose(0, 1)[None])
            outs.append(o[0].transpose(0, 1))
            off += n
        return torch.cat(outs)
