"""A contiguous KV cache for one request, and the step attention that uses it.

Without a cache, step t recomputes K and V for all t previous tokens although they never
change (a token's K/V depend only on the tokens before it). With a cache, each step computes
K/V for the new token(s) only, appends them, and attends over everything stored so far.
"""
from __future__ import annotations

import torch
from torch import Tensor

from step03_attention.attention import attention
from step04_transformer.config import ModelConfig


class KVCache:
    """K and V of every layer for one sequence: [capacity, num_kv_heads, head_dim] each.

    `length` counts the positions filled. The buffers grow (doubling, with a copy) when a write
    would overflow them, so a caller may start small; lesson 12 replaces this copy with pages.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        shape = (max(1, capacity), cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    def reserve(self, total: int) -> None:
        """Make room for `total` positions, growing every layer's buffers if needed."""
        if total <= self.capacity:
            return
        new = max(total, 2 * self.capacity)
        for layer in range(self.cfg.num_layers):
            for buf in (self.k, self.v):
                grown = torch.empty((new,) + buf[layer].shape[1:], dtype=self.dtype)
                grown[: self.length] = buf[layer][: self.length]
                buf[layer] = grown

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        end = start + k.shape[0]
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    def keys_values(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        return self.k[layer][:end], self.v[layer][:end]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def cached_attention(cache: KVCache, layer: int, start: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Store k/v of the new tokens at [start, start+T), attend q over positions [0, start+T).

    q [T, Hq, D], k/v [T, Hkv, D]. The new queries are the last T positions, so the causal mask
    of lesson 03 (queries at the end of a longer sequence) is exactly right for both prefill
    (start = 0) and decode (T = 1).
    """
    end = start + q.shape[0]
    cache.write(layer, start, k, v)
    keys, values = cache.keys_values(layer, end)
    out = attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
    return out[0].transpose(0, 1)


class CachedAttention:
    """Step attention for one sequence whose first `start` positions are already cached."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.start = 0

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return cached_attention(self.cache, layer_idx, self.start, q, k, v)
