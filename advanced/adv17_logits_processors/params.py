"""SamplingParams with the fields this lesson's processors read (vLLM's names where vLLM has them).

    min_tokens          no EOS / stop token before this many tokens are generated (<= max_tokens)
    allowed_token_ids   only these ids may be produced (a non-empty list)
    logit_bias          {token id: bias in [-100, 100]}, OpenAI's; JSON's string keys are accepted
    epsilon_cutoff      drop tokens with probability < epsilon, keep the best (0 = off, < 1); HF's
    logits_processors   callables (output_ids, logits_row) -> logits_row, applied in order

A bad value fails here, naming the field. Ids outside the model's vocabulary are checked where
the vocabulary is known (engine.check_token_ids).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from advanced.adv02_sampling.params import SamplingParams as PenaltyParams
from step06_sampler.params import _is_int, _is_real
from step19_real_model.params import SamplingParams as LLMSamplingParams

RowProcessor = Callable[[list[int], Tensor], Tensor]


@dataclass
class SamplingParams(LLMSamplingParams):
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    epsilon_cutoff: float = 0.0
    logits_processors: list[RowProcessor] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()

        def bad(name: str, rule: str):
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
            self.allowed_token_ids = [int(t) for t in ids]
        # The same rules as advanced lesson 02's logit_bias (OpenAI's range, string keys from JSON).
        self.logit_bias = PenaltyParams._check_logit_bias(self, bad)
        if not _is_real(self.epsilon_cutoff) or not 0.0 <= self.epsilon_cutoff < 1.0:
            bad("epsilon_cutoff", "must be a number in [0, 1)")
        self.epsilon_cutoff = float(self.epsilon_cutoff)
        if self.logits_processors is not None:
            if not isinstance(self.logits_processors, (list, tuple)) or not all(
                    callable(f) for f in self.logits_processors):
                bad("logits_processors", "must be a list of callables (output_ids, logits_row) -> logits_row")
            self.logits_processors = list(self.logits_processors)
