"""What rank 0 sends the other ranks each step, and the step attention they rebuild from it.

Only rank 0 has the scheduler, the sequences and their block tables. The workers hold weights
and a KV pool and nothing else, so each step they are told exactly what lesson 15's attention
backend computed on rank 0, plus the tokens and which rows get logits:

    header        [T, B, max_blocks, N]         four numbers
    input_ids     [T]      positions [T]        the tokens of the step and where they sit
    cu_seqlens_q  [B + 1]  seq_lens [B]         varlen description of the batch (lesson 15)
    block_tables  [B, max_blocks]
    slot_mapping  [T]                           where each token's K/V go (same block ids on
                                                every rank: the pools have the same blocks)
    logit_rows    [N]                           the rows the sampler will read

All int64, packed into one buffer: one message per worker per step, a few KB.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from step14_batched_forward.kv_pool import HeadMajorKVPool
from step15_flash_attention.attention import FlashPagedAttention
from step15_flash_attention.backends import AttentionBackend


@dataclass
class StepMetadata:
    input_ids: Tensor
    positions: Tensor
    cu_seqlens_q: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    slot_mapping: Tensor
    logit_rows: Tensor

    @classmethod
    def from_attention(cls, input_ids: Tensor, positions: Tensor, attn: FlashPagedAttention,
                     logit_rows: list[int]) -> "StepMetadata":
        return cls(input_ids, positions, attn.cu_seqlens_q, attn.seq_lens, attn.block_tables,
                   attn.slot_mapping, torch.tensor(logit_rows, dtype=torch.long))

    def to_bytes(self) -> bytes:
        T, (B, M), N = len(self.input_ids), self.block_tables.shape, len(self.logit_rows)
        header = torch.tensor([T, B, M, N], dtype=torch.long)
        parts = [header] + [getattr(self, f.name).reshape(-1).to(torch.long) for f in fields(self)]
        return torch.cat(parts).numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepMetadata":
        flat = torch.frombuffer(bytearray(data), dtype=torch.long)
        T, B, M, N = flat[:4].tolist()
        sizes = [T, T, B + 1, B, B * M, T, N]
        parts = torch.split(flat[4:], sizes)
        meta = cls(*parts)
        meta.block_tables = meta.block_tables.view(B, M)
        return meta


class MetadataAttention(FlashPagedAttention):
    """Lesson 15's step attention, built from received metadata instead of from the sequences."""

    def __init__(self, pool, meta: StepMetadata, backend: AttentionBackend):
        self.pool, self.kernel = pool, backend.kernel
        self.cu_seqlens_q, self.seq_lens = meta.cu_seqlens_q, meta.seq_lens
        self.block_tables, self.slot_mapping = meta.block_tables, meta.slot_mapping
        self.rows = pool.head_rows(self.slot_mapping) if isinstance(pool, HeadMajorKVPool) else None
