"""Lesson 19's engine and LLM with penalties, logit_bias and bad words.

    step(): schedule -> run_model(batch) ---------------> compute_logits(hidden)
                        | remember which sequences        | lesson 19 keeps the raw logits
                        | get a token this step           |   (logprobs are the model's own)
                        v                                 v
                        self._step_seqs  ----------->  apply_penalties(rows of those sequences)
                                                          -> lesson 06's sampler (temperature,
                                                             top-k, top-p, min-p) as before

The sampler never learns that penalties exist: they change the logits it is given. The
rows of the logits are the step's sampled sequences in batch order (lesson 09's rule: a
sequence whose last token is computed this step), so the mixin records them in run_model,
which every engine from lesson 09 on calls with the batch just before compute_logits.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step19_real_model.engine import LogprobsEngine
from step19_real_model.llm import LLM

from .beam_search import BeamSearchParams, BeamSequence, llm_beam_search
from .penalties import apply_penalties
from .params import SamplingParams, needs_penalties


class PenaltiesMixin:
    """Put in front of any engine of lessons 09-19: `class E(PenaltiesMixin, Engine)`."""

    _step_seqs: list[Sequence] = []

    def add_request(self, prompt_ids, params=None) -> Sequence:
        if isinstance(params, SamplingParams):
            check_token_ids(params, self.model.config.vocab_size)
        return super().add_request(prompt_ids, params)

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        self._step_seqs = [s for s, n in zip(batch.seqs, batch.num_tokens)
                           if s.num_computed_tokens + n == s.num_tokens]
        return super().run_model(batch, input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = super().compute_logits(hidden)
        seqs, self._step_seqs = self._step_seqs, []
        if not any(needs_penalties(s.params) for s in seqs):
            return logits                                     # no cost for plain requests
        if len(seqs) != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} logit rows for {len(seqs)} sampled sequences")
        return apply_penalties(logits, [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                               [s.output_token_ids for s in seqs])


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: ids inside this model's vocabulary."""
    for t in params.logit_bias or {}:
        if t >= vocab_size:
            raise ValueError(f"SamplingParams.logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})")
    for w in params.bad_words_token_ids or []:
        if any(t >= vocab_size for t in w):
            raise ValueError(f"SamplingParams.bad_words_token_ids: {w} has an id outside [0, {vocab_size})")
    if params.bad_words and params.bad_words_token_ids is None:
        raise ValueError("SamplingParams.bad_words needs a tokenizer: use AdvLLM (it fills bad_words_token_ids) "
                         "or set bad_words_token_ids yourself")


class AdvEngine(PenaltiesMixin, LogprobsEngine):
    """Lesson 19's engine (lesson 17's + logprobs) with penalties. Lesson 15's Engine keeps the
    step's logits for the logprobs output processor before this mixin's compute_logits applies
    the penalties (to a copy): logprobs stay raw, as vLLM's default."""


def build_engine(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, *, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 enforce_eager: bool = False) -> AdvEngine:
    config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  kv_cache_bytes=kv_cache_bytes)
    return AdvEngine(model_dir, config, dtype=dtype, use_graph=not enforce_eager)


def bad_words_to_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word as it starts a text and as it follows a space: BPE gives "Paris" and " Paris"
    different tokens, and a ban must catch the word in both places (vLLM does the same)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


class AdvLLM(LLM):
    """lesson 19's LLM whose engine applies this lesson's SamplingParams, plus beam_search()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.engine) is not LogprobsEngine:
            raise TypeError(f"expected lesson 19's LogprobsEngine, got {type(self.engine).__name__}")
        # The mixin adds methods and no state at construction, so the engine lesson 19 built
        # becomes an AdvEngine in place (lesson 19's LLM has no hook to choose the engine class;
        # the alternative is copying its __init__).
        self.engine.__class__ = AdvEngine

    def _params(self, sp, count: int) -> list:
        """Lesson 19's checks, then bad_words -> token ids with this model's tokenizer."""
        plist = super()._params(sp, count)
        return [dataclasses.replace(p, bad_words_token_ids=bad_words_to_ids(self.tokenizer, p.bad_words))
                if isinstance(p, SamplingParams) and p.bad_words and p.bad_words_token_ids is None else p
                for p in plist]

    def beam_search(self, prompts, params: BeamSearchParams) -> list[list[BeamSequence]]:
        """The beam_width best sequences of each prompt, best first (vLLM's LLM.beam_search)."""
        return llm_beam_search(self, prompts, params)
