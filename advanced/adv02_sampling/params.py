"""SamplingParams with the knobs of OpenAI's and vLLM's APIs that act on the logits before the
sampler sees them.

    presence_penalty    [-2, 2]   subtract it once from every token already GENERATED
    frequency_penalty   [-2, 2]   subtract it once per time a token was generated
    repetition_penalty  > 0       tokens seen in the prompt OR the output: positive logits are
                                  divided by it, negative ones multiplied (1 = off; HF/vLLM/CTRL)
    logit_bias          {token id: bias in [-100, 100]} added to the logits (OpenAI's keys are
                        strings of digits in JSON; they are accepted too)
    bad_words           strings never to produce; the LLM turns them into token sequences
    bad_words_token_ids those token sequences (set by the LLM from bad_words, or by hand)

The ranges are OpenAI's (presence/frequency, logit_bias) and vLLM's (repetition > 0). A bad
value fails here, naming the field, not in the middle of a batched step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from step06_sampler.params import _is_int, _is_real
from step19_real_model.params import SamplingParams as LLMSamplingParams


@dataclass
class SamplingParams(LLMSamplingParams):
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()

        def bad(name: str, rule: str):
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                bad(name, "must be a number in [-2, 2]")
            setattr(self, name, float(v))
        if not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a finite number > 0 (1 turns it off)")
        self.repetition_penalty = float(self.repetition_penalty)
        self.logit_bias = self._check_logit_bias(bad)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                bad("bad_words", "must be a list of non-empty strings")
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            ok = not isinstance(self.bad_words_token_ids, (str, bytes)) and all(
                isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w)
                for w in self.bad_words_token_ids)
            if not ok:
                bad("bad_words_token_ids", "must be a list of non-empty lists of token ids")
            self.bad_words_token_ids = [[int(t) for t in w] for w in self.bad_words_token_ids]

    def _check_logit_bias(self, bad) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias", "must be a dict {token id: bias}")
        out: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            if isinstance(k, str) and k.strip().isdigit():       # JSON object keys are strings
                k = int(k)
            if not _is_int(k) or k < 0:
                bad("logit_bias", f"keys must be token ids (integers >= 0); {k!r} is not")
            if not _is_real(v) or not -100.0 <= v <= 100.0:
                bad("logit_bias", f"values must be numbers in [-100, 100]; token {k} has {v!r}")
            out[int(k)] = float(v)
        return out

    @property
    def has_penalties(self) -> bool:
        """True when the logits must be changed before sampling (the engine skips the work otherwise)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.bad_words_token_ids or self.bad_words)


def needs_penalties(params) -> bool:
    """Works for any engine params: only this lesson's SamplingParams carry penalties."""
    return isinstance(params, SamplingParams) and params.has_penalties
