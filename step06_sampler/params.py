"""SamplingParams: what one request asks the sampler (and, later, the engine) to do.

The fields and their meaning follow vLLM's `SamplingParams`, reduced to the ones this
tutorial implements. Bad values fail at construction, with the field's name in the message,
so a typo in a request is reported where it was made and not deep inside a batched step.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field

# Temperatures below this are treated as 0, i.e. greedy: T = 0 would divide by zero, and
# below it softmax(logits / T) is one-hot at the argmax anyway. vLLM uses the same cut-off.
SAMPLING_EPS = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    temperature     divide the logits by this before softmax; 0 means greedy (argmax).
    top_k           keep only the k most likely tokens; -1 or 0 turns it off.
    top_p           keep the smallest set of most likely tokens whose probability reaches p.
    min_p           keep tokens whose probability is at least min_p * (top probability).
    max_tokens      stop after this many generated tokens.
    stop_token_ids  stop as soon as one of these tokens is generated.
    ignore_eos      keep going past the model's end-of-sequence token.
    seed            give the request its own random stream: same seed, same tokens,
                    whatever else is in the batch.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, rule: str):
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (-1 or 0 turns it off)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be True or False")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        # Normalise types once, so the rest of the code can rely on plain Python values.
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        self.top_k, self.max_tokens = int(self.top_k), int(self.max_tokens)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.seed = None if self.seed is None else int(self.seed)

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step (no randomness)."""
        return self.temperature < SAMPLING_EPS

    def finish_reason(self, token_id: int, num_generated: int,
                      eos_token_id: int | Collection[int] | None) -> str | None:
        """Why a request stops after generating `token_id` as its `num_generated`-th token.

        Returns "length" (max_tokens reached), "stop" (EOS unless ignore_eos, or a stop token),
        or None (keep going). `eos_token_id` may be one id or several (some checkpoints list
        more than one). Like vLLM, the length cap is checked first. The names are the
        `finish_reason` values of the OpenAI API that lesson 20 serves.
        """
        if num_generated >= self.max_tokens:
            return "length"
        eos = () if eos_token_id is None else (eos_token_id,) if _is_int(eos_token_id) else eos_token_id
        if token_id in eos and not self.ignore_eos:
            return "stop"
        if token_id in self.stop_token_ids:
            return "stop"
        return None
