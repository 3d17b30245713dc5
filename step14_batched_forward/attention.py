"""Attention for the whole batch at once, reading K/V from the paged pool.

Lesson 12 looped over sequences in Python (one small attention per sequence, per layer). Here
every step builds a little metadata once, then each layer does:

    1. one scatter    pool[slot_mapping] = k, v              (all new tokens of all sequences)
    2. decodes        one call of the C++ paged kernel: every K/V row read once, in place,
                      through the block tables (kernel.py, paged_decode.cpp)
       prefill chunks one gather  blocks = pool[block_tables] -> [B', Hkv, L, D]
                      one SDPA with a causal + length mask over padded [B', Qmax] queries

Without the kernel (no compiler, or use_kernel=False) decodes take the gather path too, with
two batched matmuls: the same numbers, but every K/V byte is read, written and read again.
Queries fold each KV head's `group` query heads into the query dimension, so GQA needs no
repeated K/V. Prefill chunks and decodes are two calls because padding a one-token decode to
the length of a 500-token chunk would waste 500x the work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from step09_continuous_batching.scheduler import ScheduledBatch
from step14_batched_forward import kernel
from step14_batched_forward.kv_pool import HeadMajorKVPool


@dataclass
class Group:
    """Sequences that share one attention call: their rows in the flat batch and their tables."""
    rows: Tensor          # [B, Qmax] index of each query token in the flat batch (pads -> 0)
    valid: Tensor         # [B, Qmax] bool, real query tokens
    block_tables: Tensor  # [B, max_blocks] (pads -> block 0, masked out)
    lens: Tensor          # [B] keys each sequence attends to after this step's write
    mask: Tensor | None   # [B, 1, Qmax, L] bool: may attend (None for decodes: length mask only)


def _build_group(seqs, ns, offsets, block_size: int) -> Group:
    B = len(seqs)
    qmax = max(ns)
    max_blocks = max(len(s.block_table) for s in seqs)
    L = max_blocks * block_size
    rows = torch.zeros(B, qmax, dtype=torch.long)
    valid = torch.zeros(B, qmax, dtype=torch.bool)
    tables = torch.zeros(B, max_blocks, dtype=torch.long)
    starts = torch.tensor([s.num_computed_tokens for s in seqs])
    for i, (s, n, off) in enumerate(zip(seqs, ns, offsets)):
        rows[i, :n] = torch.arange(off, off + n)
        valid[i, :n] = True
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table)
    key_pos = torch.arange(L)
    q_pos = starts[:, None] + torch.arange(qmax)[None, :]                       # [B, Qmax]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]                          # causal, and
    lens = starts + torch.tensor(ns)
    mask = mask & (key_pos[None, None, :] < lens[:, None, None])                 # within length
    return Group(rows, valid, tables, lens, mask[:, None])


class Workspace:
    """Gather buffers kept across steps and layers.

    A fresh 100 MB tensor per layer is mostly page faults here (glibc hands big blocks back to
    the OS and the kernel zero-fills them again on first touch); writing into buffers that are
    already mapped costs only the copy.
    """

    def __init__(self):
        self.k = self.v = None
        self.scores = torch.empty(0)

    def get(self, n: int, tail: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.k is None or self.k.shape[0] < n or self.k.shape[1:] != tail or self.k.dtype != dtype:
            size = max(n, 2 * self.k.shape[0]) if self.k is not None and self.k.shape[1:] == tail else n
            self.k = torch.empty((size,) + tail, dtype=dtype)
            self.v = torch.empty((size,) + tail, dtype=dtype)
        return self.k[:n], self.v[:n]

    def get_scores(self, n: int) -> Tensor:
        if self.scores.numel() < n:
            self.scores = torch.empty(n, dtype=torch.float32)
        return self.scores


class VarlenPagedAttention:
    """Backend: the whole batch per layer: one scatter, then decodes through the paged kernel
    and prefill chunks through gather + SDPA (or everything through the gather when
    `use_kernel` is False or the kernel cannot be built)."""

    def __init__(self, pool: HeadMajorKVPool, batch: ScheduledBatch, workspace: Workspace | None = None,
                 use_kernel: bool = True):
        self.pool = pool
        self.workspace = workspace or Workspace()
        self.use_kernel = use_kernel and kernel.load() is not None
        bs = pool.block_size
        slots, offsets, off = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            table, start = seq.block_table, seq.num_computed_tokens
            pos = torch.arange(start, start + n)
            slots.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
            offsets.append(off)
            off += n
        self.slot_mapping = torch.cat(slots)
        self.rows = pool.head_rows(self.slot_mapping)        # computed once, used by every layer
        dec = [i for i, n in enumerate(batch.num_tokens) if n == 1]
        pre = [i for i, n in enumerate(batch.num_tokens) if n > 1]
        self.groups = []
        for idx in (dec, pre):
            if idx:
                g = _build_group([batch.seqs[i] for i in idx], [batch.num_tokens[i] for i in idx],
                                 [offsets[i] for i in idx], bs)
                self.groups.append((g, pool.piece_index(g.block_tables)))

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pool = self.pool
        pool.write(layer_idx, self.slot_mapping, k, v, self.rows)
        out = torch.empty_like(q)
        T, Hq, D = q.shape
        Hkv, bs = pool.num_kv_heads, pool.block_size
        group = Hq // Hkv
        for g, pieces in self.groups:
            B, qmax = g.rows.shape
            if qmax == 1 and self.use_kernel:
                # Decodes: the C++ kernel reads each K/V row once, in place, through the block table.
                rows = g.rows[:, 0]
                scores = self.workspace.get_scores(B * Hq * g.block_tables.shape[1] * bs)
                with torch.profiler.record_function("paged_decode_kernel"):    # named in profiles
                    out[rows] = kernel.paged_decode_attention(q[rows], pool.k[layer_idx], pool.v[layer_idx],
                                                              g.block_tables, g.lens, scores,
                                                              check=layer_idx == 0)  # same tables every layer
                continue
            kb, vb = self.workspace.get(pieces.numel(), (bs, D), q.dtype)
            torch.index_select(pool.k[layer_idx].view(-1, bs, D), 0, pieces, out=kb)
            torch.index_select(pool.v[layer_idx].view(-1, bs, D), 0, pieces, out=vb)
            keys, values = kb.view(B, Hkv, -1, D), vb.view(B, Hkv, -1, D)   # contiguous, no transpose
            qg = q[g.rows.flatten()].view(B, qmax, Hkv, group, D)
            qg = qg.permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * qmax, D)  # fold GQA: rows (group, qmax)
            if qmax == 1:
                # Decodes: two batched matmuls; the only mask is each sequence's length.
                scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(D ** -0.5)
                probs = scores.masked_fill_(~g.mask, float("-inf")).softmax(-1).to(q.dtype)
                o = torch.matmul(probs, values)
            else:
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask.repeat(1, 1, group, 1))
            o = o.view(B, Hkv, group, qmax, D).permute(0, 3, 1, 2, 4).reshape(B, qmax, Hq, D)
            out[g.rows[g.valid]] = o[g.valid]
        return out
