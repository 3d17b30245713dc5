"""Advanced 02's engine and LLM with guided decoding: a constraint per request, masks in the sampler.

    LLM.generate(prompt, SamplingParams(structured_outputs=...))
      -> engine.add_request: constraint -> regex -> DFA -> TokenIndex (cached per pattern)
                             seq.guide = GuideState(index)         (one DFA state per request)
      -> each step: run_model records the step's sampled sequences (advanced 02's mixin)
                    compute_logits hands their guides to the sampler (None for free rows)
                    GuidedSampler masks the guided rows, draws, steps each guide

The vocabulary (token id -> bytes) comes from the tokenizer, which the engine does not have:
GuidedLLM builds it once and gives it to the engine. EOS is allowed only in accepting states,
so a guided answer that ends by EOS always matches in full; one cut by max_tokens may not.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor

from advanced.adv02_sampling.engine import AdvEngine, AdvLLM

from .dfa import compile_regex
from .params import constraint_of
from .sampler import GuidedSampler
from .token_index import GuideState, TokenIndex, TokenVocab

MAX_CACHED_INDEXES = 64     # each holds one mask per visited state; old patterns are dropped first


class GuidedMixin:
    """Put in front of advanced 02's AdvEngine: `class E(GuidedMixin, AdvEngine)`."""

    guide_vocab: TokenVocab | None = None

    def token_index(self, regex: str) -> TokenIndex:
        """One TokenIndex per pattern, shared by every request that uses it (its masks too)."""
        cache = self.__dict__.setdefault("_indexes", OrderedDict())
        if regex in cache:
            cache.move_to_end(regex)
            return cache[regex]
        if self.guide_vocab is None:
            raise ValueError("structured_outputs needs the model's vocabulary: use GuidedLLM "
                             "(or set engine.guide_vocab = TokenVocab.from_hf(tokenizer, ...))")
        index = cache[regex] = TokenIndex(compile_regex(regex), self.guide_vocab)
        if len(cache) > MAX_CACHED_INDEXES:
            cache.popitem(last=False)
        return index

    def add_request(self, prompt_ids, params=None):
        constraint = constraint_of(params)
        guide = GuideState(self.token_index(constraint.to_regex())) if constraint is not None else None
        seq = super().add_request(prompt_ids, params)     # compile first: a bad constraint queues nothing
        seq.guide = guide
        return seq

    def compute_logits(self, hidden: Tensor) -> Tensor:
        seqs = self._step_seqs                              # set by advanced 02's run_model
        logits = super().compute_logits(hidden)             # penalties (if any) come first
        guides = [getattr(s, "guide", None) for s in seqs]
        guided = any(g is not None for g in guides)
        if isinstance(self.sampler, GuidedSampler):
            self.sampler.pending = guides if guided else None     # never a stale list from another step
        elif guided:
            raise RuntimeError("a guided request needs the engine's sampler to be a GuidedSampler")
        return logits


class GuidedEngine(GuidedMixin, AdvEngine):
    """Lesson 19's engine with advanced 02's penalties and this lesson's constraints."""


class GuidedLLM(AdvLLM):
    """Advanced 02's LLM whose requests may carry structured_outputs (params.SamplingParams)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        engine = self.engine
        engine.__class__ = GuidedEngine                     # methods only, as advanced 02 does
        engine.sampler = GuidedSampler(engine.sampler)
        engine.guide_vocab = TokenVocab.from_hf(self.tokenizer, self.vocab_size, engine.eos_ids)
