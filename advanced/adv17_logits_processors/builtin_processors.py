"""The built-in processors: min_tokens, allowed_token_ids, logit_bias, epsilon_cutoff and the
per-request callables, each one RowStateProcessor over the whole batch.

    processor            state per row                  apply to [B, V]                  argmax-
                                                                                          invariant
    AllowedTokenIds      bool mask [V]                  -inf outside the mask             no
    MinTokens            (min_tokens, stop ids, output) -inf on stop ids while too short  no
    LogitBias            ({id: bias})                   one indexed add for the batch     no
    PerRequestCallables  ([fn], output)                 fn(output_ids, row) per row       no (unknown)
    EpsilonCutoff        epsilon                        -inf where p < epsilon, best kept yes

The order is vLLM's: the allowed-ids mask first, then the processors that may change the argmax,
then the argmax-invariant ones (vLLM runs min-p there; here epsilon_cutoff, as in HF's
EpsilonLogitsWarper). A request reads its settings from its params with getattr, so requests
of lesson 06/19 (which have none of these fields) pass through every processor untouched.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import Tensor

from .processors import LogitsProcessor, RowStateProcessor

NEG_INF = float("-inf")


class AllowedTokenIds(RowStateProcessor[Tensor]):
    """Only the ids in params.allowed_token_ids may be produced (vLLM's field of that name)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self._blocked: tuple[Tensor, Tensor] | None = None

    def new_state(self, params, prompt_ids, output_ids):
        ids = getattr(params, "allowed_token_ids", None)
        if not ids:
            return None
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[torch.tensor(ids, dtype=torch.long)] = True
        return allowed

    def update_state(self, batch_update) -> None:
        super().update_state(batch_update)
        if batch_update is not None:
            self._blocked = None                      # rows changed: rebuild the batch mask once

    def apply(self, logits: Tensor) -> Tensor:
        if not self.states:
            return logits
        if self._blocked is None:                     # [R, V], reused while the batch stays the same
            rows = sorted(self.states)
            self._blocked = (torch.tensor(rows, device=logits.device),
                             ~torch.stack([self.states[r] for r in rows]).to(logits.device))
        idx, blocked = self._blocked
        logits[idx] = logits[idx].masked_fill(blocked, NEG_INF)
        return logits

    def is_argmax_invariant(self) -> bool:
        return False


class MinTokens(RowStateProcessor[tuple[int, list[int], Seq[int]]]):
    """No stop token before params.min_tokens tokens are generated: EOS (unless ignore_eos) and
    params.stop_token_ids get -inf while the output is shorter (vLLM's min_tokens)."""

    def __init__(self, eos_ids: list[int]):
        super().__init__()
        self.eos_ids = list(eos_ids)

    def new_state(self, params, prompt_ids, output_ids):
        n = getattr(params, "min_tokens", 0)
        if not n:
            return None
        stops = [] if getattr(params, "ignore_eos", False) else list(self.eos_ids)
        stops += [t for t in getattr(params, "stop_token_ids", []) if t not in stops]
        return (n, stops, output_ids) if stops else None

    def apply(self, logits: Tensor) -> Tensor:
        rows, cols = [], []
        for row, (n, stops, output_ids) in self.states.items():
            if len(output_ids) < n:            # output_ids is live: the state needs no update per token
                rows += [row] * len(stops)
                cols += stops
        if rows:
            logits[torch.tensor(rows), torch.tensor(cols)] = NEG_INF
        return logits

    def is_argmax_invariant(self) -> bool:
        return False


class LogitBias(RowStateProcessor[dict[int, float]]):
    """Add params.logit_bias[token] to the logits (OpenAI's logit_bias; advanced lesson 02 has the
    same arithmetic as one stage of its penalties)."""

    def new_state(self, params, prompt_ids, output_ids):
        return getattr(params, "logit_bias", None) or None

    def apply(self, logits: Tensor) -> Tensor:
        if not self.states:
            return logits
        rows, cols, vals = [], [], []
        for row, bias in self.states.items():
            rows += [row] * len(bias)
            cols += list(bias)
            vals += list(bias.values())
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)),
                          torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
        return logits

    def is_argmax_invariant(self) -> bool:
        return False


class PerRequestCallables(RowStateProcessor[tuple[list, Seq[int]]]):
    """params.logits_processors: callables (output_ids, logits_row) -> logits_row, vLLM V0's
    per-request processors, run one row at a time inside the batch interface. Nothing is known
    about what they do, so they are never skipped."""

    def new_state(self, params, prompt_ids, output_ids):
        fns = getattr(params, "logits_processors", None)
        return (list(fns), output_ids) if fns else None

    def apply(self, logits: Tensor) -> Tensor:
        for row, (fns, output_ids) in self.states.items():
            ids = list(output_ids)
            x = logits[row]
            for fn in fns:
                x = fn(ids, x)
                if not isinstance(x, Tensor) or x.shape != logits[row].shape:
                    raise TypeError(f"a logits processor must return a tensor of shape {tuple(logits[row].shape)}, "
                                    f"got {type(x).__name__} {getattr(x, 'shape', '')}")
            logits[row] = x
        return logits

    def is_argmax_invariant(self) -> bool:
        return False


class EpsilonCutoff(RowStateProcessor[float]):
    """Tokens with probability below params.epsilon_cutoff get -inf; the most likely token is
    always kept (HF's EpsilonLogitsWarper with min_tokens_to_keep=1). It removes only tokens
    below the best one, so it is argmax-invariant: an all-greedy step skips it."""

    def new_state(self, params, prompt_ids, output_ids):
        return getattr(params, "epsilon_cutoff", 0.0) or None

    def apply(self, logits: Tensor) -> Tensor:
        if not self.states:
            return logits
        rows = sorted(self.states)
        idx = torch.tensor(rows, device=logits.device)
        eps = torch.tensor([self.states[r] for r in rows], device=logits.device).unsqueeze(1)
        x = logits[idx]
        probs = x.softmax(dim=-1)
        remove = (probs < eps) & (x < x.amax(dim=-1, keepdim=True))
        logits[idx] = x.masked_fill(remove, NEG_INF)
        return logits

    def is_argmax_invariant(self) -> bool:
        return True


def builtin_processors(vocab_size: int, eos_ids: list[int]) -> list[LogitsProcessor]:
    """The engine's processors, in the order they run."""
    return [AllowedTokenIds(vocab_size), MinTokens(eos_ids), LogitBias(), PerRequestCallables(), EpsilonCutoff()]


def uses_processors(params: Any) -> bool:
    """True when a request sets any field a built-in processor reads."""
    return any(getattr(params, f, None) for f in ("allowed_token_ids", "min_tokens", "logit_bias",
                                                  "logits_processors", "epsilon_cutoff"))
