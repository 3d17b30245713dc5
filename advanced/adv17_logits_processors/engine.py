"""Lesson 19's engine and LLM with logits processors in the sampler.

    step(): schedule --> run_model(batch) ----------------------> compute_logits(hidden)
                          | the step's sampled sequences, in         | lesson 15 keeps these raw
                          | logits order (lesson 09's rule)          |   logits for logprobs
                          v                                          v
                          PersistentBatch.update -> BatchUpdate      sampler(logits, params)
                          sampler.update_state(update)  ---------->  = ProcessorSampler: processors
                                                                       on a copy, then lesson 06/16's

Nothing of lessons 09-19 changes: the mixin sees the batch in run_model (every engine from
lesson 09 on calls it just before compute_logits) and the engine's sampler is wrapped.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step19_real_model.engine import LogprobsEngine
from step19_real_model.llm import LLM

from .builtin_processors import builtin_processors
from .persistent_batch import PersistentBatch
from .processors import LogitsProcessor, ProcessorSampler


class ProcessorsMixin:
    """Put in front of an engine of lessons 15-19 and call attach_processors on it."""

    persistent_batch: PersistentBatch
    sampler: ProcessorSampler

    def add_request(self, prompt_ids, params=None) -> Sequence:
        if params is not None:
            check_token_ids(params, self.model.config.vocab_size)
        return super().add_request(prompt_ids, params)

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        sampled = [s for s, n in zip(batch.seqs, batch.num_tokens) if s.num_computed_tokens + n == s.num_tokens]
        self.sampler.update_state(self.persistent_batch.update(sampled))
        return super().run_model(batch, input_ids, positions)


def check_token_ids(params, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: ids inside this model's vocabulary."""
    for name in ("allowed_token_ids", "logit_bias"):
        bad = [t for t in getattr(params, name, None) or () if t >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


class ProcessorEngine(ProcessorsMixin, LogprobsEngine):
    """Lesson 19's engine (logprobs from the raw logits) with this lesson's processors."""


def attach_processors(engine: LogprobsEngine, processors: list[LogitsProcessor] | None = None,
                      skip_argmax_invariant: bool = True) -> ProcessorEngine:
    """Turn lesson 19's engine into a ProcessorEngine in place: the built-ins unless processors
    are given (they replace them: pass builtin_processors(...) + yours to keep both)."""
    if type(engine) is not LogprobsEngine:
        raise TypeError(f"expected lesson 19's LogprobsEngine, got {type(engine).__name__}")
    if engine.has_unfinished():
        raise RuntimeError("attach processors to an idle engine: rows of running requests would be unknown")
    cfg = engine.model.config
    if processors is None:
        processors = builtin_processors(cfg.vocab_size, engine.eos_ids)
    # lesson 19's LLM builds the engine itself and has no hook for the class; the mixin adds
    # methods only, so the object becomes a ProcessorEngine in place (as advanced lesson 02 does).
    engine.__class__ = ProcessorEngine
    engine.persistent_batch = PersistentBatch()
    engine.sampler = ProcessorSampler(engine.sampler, processors, skip_argmax_invariant)
    return engine


class ProcessorLLM(LLM):
    """Lesson 19's LLM whose engine runs the built-in processors (and per-request callables)."""

    def __init__(self, model: str | Path | None = None, *, processors: list[LogitsProcessor] | None = None,
                 skip_argmax_invariant: bool = True, **kwargs):
        super().__init__(model, **kwargs)
        attach_processors(self.engine, processors, skip_argmax_invariant)

    @property
    def sampler(self) -> ProcessorSampler:
        return self.engine.sampler


def build_engine(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, **kwargs) -> ProcessorEngine:
    """Lesson 19's build_engine (same keywords), with the built-in processors attached."""
    from step19_real_model.engine import build_engine as lesson19_build
    return attach_processors(lesson19_build(model_dir, dtype, **kwargs))
