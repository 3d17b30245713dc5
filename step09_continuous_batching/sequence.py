"""A request as the engine sees it: its tokens, how many of them are already in the KV cache,
and where it is in its life (waiting -> running -> finished, and back to waiting if preempted)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from step06_sampler.params import SamplingParams
from step06_sampler.sampler import make_generator

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival_time: float = field(default_factory=time.perf_counter)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # when each output token appeared
    kv_cache: Any = None                  # lessons 09-11: its own contiguous KV cache (lesson 07)
    block_table: list[int] | None = None  # lesson 12 on: the ids of its blocks in the paged KV pool
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.token_ids = list(self.prompt_token_ids)
        self.generator = make_generator(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: the prompt at first, then 1 per decode step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
