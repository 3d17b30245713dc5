"""SamplingParams as a user of vLLM's `LLM` knows them: lesson 06's fields plus the ones that
live above the engine.

    n                         how many completions of each prompt (each is its own engine request)
    stop                      strings that end a completion; found in the text, not in the tokens
    include_stop_str_in_output  keep the stop string at the end of the text (default: cut it)
    logprobs                  per generated token, the log-probabilities of the top `logprobs`
                              tokens and of the chosen one (0: the chosen one only)
    skip_special_tokens       leave special tokens (<|im_end|>, ...) out of the text

The engine only ever sees one completion at a time: `child(i)` is the request for completion i
of n. A seeded request gives completion i the seed `seed + i`, so the n completions differ from
each other and the whole set is reproducible.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from step06_sampler.params import SamplingParams as EngineSamplingParams
from step06_sampler.params import _is_int

MAX_LOGPROBS = 20          # what OpenAI's chat API allows for top_logprobs (vLLM's default cap too)


@dataclass
class SamplingParams(EngineSamplingParams):
    n: int = 1
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()

        def bad(name: str, rule: str):
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop = stop
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")
        self.n = int(self.n)

    def child(self, i: int) -> "SamplingParams":
        """The engine request for completion i of n: n=1, seed + i. Always a new object, so
        every engine request has params of its own (lesson 20 finds requests by them)."""
        if not 0 <= i < self.n:
            raise ValueError(f"completion index {i} is outside [0, n={self.n})")
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
