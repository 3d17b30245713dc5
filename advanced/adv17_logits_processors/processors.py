"""The logits-processor interface: batch-level objects the sampler calls on every step.

    engine step:  which requests get a token, in which logits row
                      |  PersistentBatch (persistent_batch.py) compares with last step
                      v
                  BatchUpdate(added, removed, moved) --update_state--> every processor
                      |                                                 (per-row state)
    logits [B, V] --> ProcessorSampler: apply(logits) of each processor --> lesson 06's sampler

A processor never sees a request id: it sees rows. Its state follows the rows through the
BatchUpdate each step (vLLM V1's design): a request that joins is `added` at a row, one that
leaves frees its row (`removed`), and rows are renumbered by `moved` entries so the batch stays
dense and in the order of the step's logits. Applying a processor is then one batched tensor
operation on [B, V] instead of one Python call per request.

A processor that can never change which token has the largest logit (it only removes tokens
below the best one, or rescales) says so with is_argmax_invariant(); when every row of the step
is greedy, the sampler skips it: its work cannot change a single token.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Generic, TypeVar

from torch import Tensor


class MoveDirection(Enum):
    SWAP = "swap"                    # rows a and b exchange their requests
    UNIDIRECTIONAL = "move"          # the request of row a goes to row b; row a becomes empty


@dataclass(frozen=True)
class AddedRequest:
    """A request that takes `row`. output_ids is live: it grows as the request generates, so a
    processor may keep it and read its length every step without being told again."""
    row: int
    params: Any
    prompt_ids: list[int]
    output_ids: Seq[int]


@dataclass
class BatchUpdate:
    """What changed in the batch since the last step, applied in this order:

    added     requests that take a row; a row that a new request takes is listed here only
              (its old state, if any, is simply replaced)
    removed   rows left empty by requests that left
    moved     (a, b, direction), in order: SWAP exchanges rows a and b, UNIDIRECTIONAL moves a to b
    """
    batch_size: int
    added: list[AddedRequest] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    moved: list[tuple[int, int, MoveDirection]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.moved)


class LogitsProcessor(ABC):
    """vLLM V1's interface, three methods. apply may change logits in place and return them."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch: None means nothing changed (outputs may still have grown)."""

    @abstractmethod
    def apply(self, logits: Tensor) -> Tensor:
        """logits [B, V] float32, rows in the order of the last BatchUpdate."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if apply can never change any row's argmax (the sampler may then skip it)."""

    def is_active(self) -> bool:
        """False when no row needs this processor: the sampler then leaves it out (and makes
        no copy of the logits for it). Processors that cannot tell return True."""
        return True


S = TypeVar("S")


class RowStateProcessor(LogitsProcessor, Generic[S]):
    """A processor whose state is one object per row that needs it: {row: state}.

    Subclasses say what state a request gets (new_state: None = this request does not use me)
    and how to apply the states to the batch. The bookkeeping (add, remove, move) is here once.
    """

    def __init__(self) -> None:
        self.states: dict[int, S] = {}

    @abstractmethod
    def new_state(self, params: Any, prompt_ids: list[int], output_ids: Seq[int]) -> S | None:
        ...

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for a in batch_update.added:
            state = self.new_state(a.params, a.prompt_ids, a.output_ids)
            if state is None:
                self.states.pop(a.row, None)          # the row's previous request's state goes
            else:
                self.states[a.row] = state
        for row in batch_update.removed:
            self.states.pop(row, None)
        for a, b, direction in batch_update.moved:
            sa, sb = self.states.pop(a, None), self.states.pop(b, None)
            if sa is not None:
                self.states[b] = sa
            if direction is MoveDirection.SWAP and sb is not None:
                self.states[a] = sb

    def is_active(self) -> bool:
        return bool(self.states)


class ProcessorSampler:
    """Lesson 06's sampler (or lesson 16's KernelSampler) with logits processors in front.

    The logits it is given are the engine's step logits, which lesson 19's output processor
    reads afterwards for logprobs: the processors work on a copy, so logprobs stay raw (vLLM's
    default). The copy is made only when some processor is active for this step.
    """

    def __init__(self, inner: Callable, processors: list[LogitsProcessor], skip_argmax_invariant: bool = True):
        self.inner = inner
        self.processors = list(processors)
        self.skip_argmax_invariant = skip_argmax_invariant
        self.processor_seconds = 0.0          # time spent in apply(), summed over steps
        self.steps = 0
        self.skipped = 0                      # processor applications skipped (all rows greedy)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for p in self.processors:
            p.update_state(batch_update)

    def process(self, logits: Tensor, params: list) -> Tensor:
        """The logits the inner sampler sees: each active processor applied, in list order."""
        all_greedy = all(getattr(p, "greedy", False) for p in params)
        todo = []
        for p in self.processors:
            if not p.is_active():
                continue
            if all_greedy and self.skip_argmax_invariant and p.is_argmax_invariant():
                self.skipped += 1                     # cannot change an argmax: no work
                continue
            todo.append(p)
        if not todo:
            return logits
        start = time.perf_counter()
        x = logits.float().clone()
        for p in todo:
            x = p.apply(x)
        self.processor_seconds += time.perf_counter() - start
        return x

    def __call__(self, logits: Tensor, params: list, generators: list | None = None) -> Tensor:
        self.steps += 1
        return self.inner(self.process(logits, params), params, generators)

    def __getattr__(self, name: str):
        # probs(), filtered_logits(), argmax: the inner sampler's (advanced lesson 03 calls probs)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
