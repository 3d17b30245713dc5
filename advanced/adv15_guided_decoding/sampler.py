"""Lesson 06's batched sampler with per-row token masks: guided rows and free rows in one batch.

    logits [B, V] --rows with a guide: -inf outside guide.allowed()--> lesson 06's filters and draw
                  --> tokens [B] --each guide steps its DFA state with its row's token

Only the guided rows are touched (a copy of the logits is made only when there is one), so an
unconstrained request in the same batch gets exactly the tokens it would get alone. The mask
goes in before temperature, top-k, top-p and min-p: those then work on the allowed tokens only,
as in vLLM, where the grammar bitmask is applied to the logits before the sampler's filters.

xgrammar and llguidance hand the mask over as a packed bitmask (int32 words, 32 tokens each,
4.7 KiB for a 151k vocabulary) and unpack it in a kernel; here each state's mask is a cached
bool tensor (one byte per token), which torch applies with one masked_fill per step.
"""
from __future__ import annotations

import torch
from torch import Tensor

from step06_sampler.sampler import NEG_INF, Sampler

from .token_index import GuideState


def apply_guides(logits: Tensor, guides: list[GuideState | None]) -> Tensor:
    """-inf on the tokens each guided row may not take; unguided rows (None) are left alone."""
    rows = [i for i, g in enumerate(guides) if g is not None]
    if not rows:
        return logits
    if len(guides) != logits.shape[0]:
        raise ValueError(f"{len(guides)} guides for {logits.shape[0]} logit rows")
    allowed = torch.stack([guides[i].allowed() for i in rows]).to(logits.device)
    if allowed.shape[1] != logits.shape[1]:
        raise ValueError(f"the guide's vocabulary has {allowed.shape[1]} tokens, the logits {logits.shape[1]}")
    out = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, NEG_INF)
    return out


class GuidedSampler(Sampler):
    """A Sampler that masks guided rows first and steps their guides with the drawn tokens.

    The engine hands the step's guides (one per logit row, None for free rows) to `pending`
    before it calls the sampler with lesson 09's signature; a direct caller passes guides=."""

    def __init__(self, inner: Sampler | None = None):
        self.argmax = inner.argmax if inner is not None else Sampler.argmax   # keep lesson 16's C argmax
        self.pending: list[GuideState | None] | None = None

    def __call__(self, logits: Tensor, params, generators=None, guides: list[GuideState | None] | None = None) -> Tensor:
        guides, self.pending = (guides if guides is not None else self.pending), None
        if guides is None or all(g is None for g in guides):
            return super().__call__(logits, params, generators)
        tokens = super().__call__(apply_guides(logits, guides), params, generators)
        for guide, token in zip(guides, tokens.tolist()):
            if guide is not None:
                guide.accept(token)
        return tokens
