"""Generation with a KV cache: one forward over the prompt (prefill), then one token per step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from step04_transformer.model import CausalLM
from step05_naive.generate import check_prompt
from step06_sampler.params import SamplingParams
from step06_sampler.sampler import Sampler, make_generator
from step07_kv_cache.kv_cache import CachedAttention, KVCache


@dataclass
class CachedOutput:
    token_ids: list[int]
    finish_reason: str
    step_seconds: list[float] = field(default_factory=list)  # [0] is the prefill


@torch.inference_mode()
def generate_cached(model: CausalLM, prompt_ids: Sequence[int], params: SamplingParams,
                    eos_ids: Sequence[int] = (), sampler: Sampler | None = None) -> CachedOutput:
    cfg = model.config
    check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, params.max_tokens)
    sampler = sampler or Sampler()
    generator = make_generator(params)
    dtype = model.model.embed_tokens.weight.dtype
    cache = KVCache(cfg, len(prompt_ids) + params.max_tokens, dtype)
    attn = CachedAttention(cache)

    out = CachedOutput(token_ids=[], finish_reason="length")
    new_ids = torch.tensor([int(t) for t in prompt_ids])
    while True:
        t0 = time.perf_counter()
        start = cache.length
        positions = torch.arange(start, start + len(new_ids))
        attn.start = start
        hidden = model(new_ids, positions, attn)     # only the tokens not yet cached
        cache.length = start + len(new_ids)
        token = int(sampler(model.compute_logits(hidden[-1:]), [params], [generator])[0])
        out.step_seconds.append(time.perf_counter() - t0)
        out.token_ids.append(token)
        reason = params.finish_reason(token, len(out.token_ids), eos_ids)
        if reason:
            out.finish_reason = reason
            return out
        new_ids = torch.tensor([token])
