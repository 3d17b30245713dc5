"""Greedy generation the slow, obviously-correct way: every step runs the whole sequence again.

Step t costs a forward over prompt_len + t tokens, so the time per token grows with the length
and the total grows quadratically. Lesson 07 fixes that with a KV cache; every later engine is
tested against this loop, token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from step04_transformer.model import CausalLM


@dataclass
class NaiveOutput:
    token_ids: list[int]                 # generated tokens only (the prompt is not repeated)
    finished_by_eos: bool
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_len: int, max_new_tokens: int) -> None:
    """The input errors every engine must report clearly instead of crashing deep inside torch."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: at least one token is needed to predict the next one")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > max_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context of {max_len} positions")


@torch.inference_mode()
def generate_naive(model: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int,
                   eos_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> NaiveOutput:
    cfg = model.config
    check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)
    tokens = [int(t) for t in prompt_ids]
    out = NaiveOutput(token_ids=[], finished_by_eos=False)
    for _ in range(max_new_tokens):
        t0 = time.perf_counter()
        ids = torch.tensor(tokens)
        hidden = model(ids, torch.arange(len(tokens)))   # the whole sequence, again
        nxt = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.step_seconds.append(time.perf_counter() - t0)
        out.token_ids.append(nxt)
        tokens.append(nxt)
        if nxt in eos_token_ids and not ignore_eos:
            out.finished_by_eos = True
            break
    return out
