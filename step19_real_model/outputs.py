"""What `LLM.generate` returns, shaped like vLLM's outputs: one RequestOutput per prompt, holding
one CompletionOutput per completion (n of them)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float                     # natural log of the model's probability (raw logits, T=1)
    rank: int                          # 1 = the most likely token
    decoded_token: str | None = None   # filled in by the LLM, which has the tokenizer


@dataclass
class RequestMetrics:
    arrival_time: float                # perf_counter when the request was added
    first_token_time: float | None
    last_token_time: float | None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.last_token_time is None else self.last_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" (EOS, stop token or stop string), "length", "abort"
    stop_reason: str | int | None = None   # the stop string or stop token id; None for EOS
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None                 # None when the prompt came as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput | None] = field(default_factory=list)   # None: not finished yet

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finished for o in self.outputs)
