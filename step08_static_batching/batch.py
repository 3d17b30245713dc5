"""Static batching: B requests run together, padded to one rectangle, until the last one ends.

    prompts (left-padded to L)            decode steps (every row, every step)
    row0  _  _  _  a  b  c  |  x  x  x  x  x  x
    row1  d  e  f  g  h  i  |  x  x  E  .  .  .    <- finished: its slot is wasted
    row2  _  _  _  _  j  k  |  x  x  x  x  x  E
Left padding puts every prompt's last token in the same column, so one decode step appends one
column for all rows. The model still sees flat tokens [B*T]; this lesson's step attention
reshapes them to [B, T], masks the pad keys, and gives each row its own positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from step03_attention.attention import attention
from step04_transformer.config import ModelConfig
from step04_transformer.model import CausalLM
from step05_naive.generate import check_prompt
from step06_sampler.params import SamplingParams
from step06_sampler.sampler import Sampler, make_generator
from step07_kv_cache.generate import CachedOutput


class PaddedKVCache:
    """K/V for a whole batch: per layer [B, capacity, Hkv, D]; column j is step j for every row."""

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype):
        shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]


class PaddedBatchAttention:
    """Backend for a [B, T] block of new tokens whose first `start` columns are cached."""

    def __init__(self, cache: PaddedKVCache, pad: Tensor):
        self.cache, self.pad, self.start = cache, pad, 0   # pad[b] = left pad length of row b

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B = self.pad.shape[0]
        T = q.shape[0] // B
        end = self.start + T
        ck, cv = self.cache.k[layer_idx], self.cache.v[layer_idx]
        ck[:, self.start:end] = k.view(B, T, *k.shape[1:])
        cv[:, self.start:end] = v.view(B, T, *v.shape[1:])
        cols = torch.arange(end)
        key_ok = cols[None, :] >= self.pad[:, None]                        # [B, end]: not a pad
        # A pad query would see no key at all (softmax of nothing = NaN, and NaN * 0 poisons the
        # real rows later); letting each query also see itself keeps pad rows finite and unused.
        own = cols[None, :] == torch.arange(self.start, end)[:, None]       # [T, end]
        mask = (key_ok[:, None, :] | own[None]).unsqueeze(1)                # [B, 1, T, end]
        out = attention(q.view(B, T, *q.shape[1:]).transpose(1, 2), ck[:, :end].transpose(1, 2),
                        cv[:, :end].transpose(1, 2), causal=True, mask=mask)
        return out.transpose(1, 2).reshape(B * T, *q.shape[1:])


@dataclass
class StaticBatchStats:
    slots: int = 0           # token positions computed (rows x columns)
    useful: int = 0          # of which real prompt tokens or tokens of unfinished requests
    step_seconds: list[float] = field(default_factory=list)

    @property
    def wasted_share(self) -> float:
        return 1 - self.useful / max(1, self.slots)


@torch.inference_mode()
def generate_static(model: CausalLM, prompts: Sequence[Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams], eos_ids: Sequence[int] = (),
                    sampler: Sampler | None = None) -> tuple[list[CachedOutput], StaticBatchStats]:
    cfg = model.config
    B = len(prompts)
    if B == 0:
        raise ValueError("no prompts given")
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * B
    if len(plist) != B:
        raise ValueError(f"got {len(plist)} SamplingParams for {B} prompts")
    for ids, p in zip(prompts, plist):
        check_prompt(ids, cfg.vocab_size, cfg.max_position_embeddings, p.max_tokens)
    sampler = sampler or Sampler()
    gens = [make_generator(p) for p in plist]
    L = max(len(ids) for ids in prompts)
    pad = torch.tensor([L - len(ids) for ids in prompts])
    cache = PaddedKVCache(cfg, B, L + max(p.max_tokens for p in plist), model.model.embed_tokens.weight.dtype)
    attn = PaddedBatchAttention(cache, pad)

    filler = eos_ids[0] if eos_ids else 0
    block = torch.tensor([[filler] * (L - len(ids)) + [int(t) for t in ids] for ids in prompts])
    outs = [CachedOutput(token_ids=[], finish_reason="length") for _ in range(B)]
    done = [False] * B
    stats = StaticBatchStats()
    start = 0
    while not all(done):
        t0 = time.perf_counter()
        T = block.shape[1]
        cols = torch.arange(start, start + T)
        positions = (cols[None, :] - pad[:, None]).clamp(min=0)   # each row counts from its own first token
        attn.start = start
        hidden = model(block.reshape(-1), positions.reshape(-1), attn).view(B, T, -1)
        nxt = sampler(model.compute_logits(hidden[:, -1]), plist, gens)
        stats.slots += B * T
        stats.useful += int((cols[None, :] >= pad[:, None]).sum()) if start == 0 else done.count(False)
        for b in range(B):
            if done[b]:
                continue
            tok = int(nxt[b])
            outs[b].token_ids.append(tok)
            reason = plist[b].finish_reason(tok, len(outs[b].token_ids), eos_ids)
            if reason:
                done[b], outs[b].finish_reason = True, reason
        stats.step_seconds.append(time.perf_counter() - t0)
        start += T
        block = nxt.view(B, 1)  # finished rows keep decoding garbage: the price of a static batch
    return outs, stats
