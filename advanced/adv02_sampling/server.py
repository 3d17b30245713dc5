"""Lesson 20's OpenAI-compatible server with this lesson's penalties in its request fields.

    request JSON                         SamplingParams (params.py)
    presence_penalty   [-2, 2]     ->    presence_penalty          (OpenAI)
    frequency_penalty  [-2, 2]     ->    frequency_penalty         (OpenAI)
    logit_bias {"id": bias}        ->    logit_bias {id: bias}     (OpenAI; keys are strings in JSON)
    repetition_penalty > 0         ->    repetition_penalty        (vLLM's extension)
    bad_words ["..."]              ->    bad_words -> token ids    (vLLM's extension)

Lesson 20 refuses the first three (its engine had no lesson for them); here its request
classes get a `check_penalties` that lets them through and a `sampling_params` that builds
this lesson's SamplingParams. The rest of the server is lesson 20's, unchanged:

    python -m advanced.adv02_sampling.server --model PATH --port 8000   (lesson 20's flags)
"""
from __future__ import annotations

from typing import Annotated, AsyncIterator

from pydantic import BaseModel, Field, StrictStr

from step18_benchmark.faults import FaultPolicy
from step19_real_model.params import SamplingParams as LLMSamplingParams
from step20_http_serve import protocol
from step20_http_serve.__main__ import main
from step20_http_serve.api import _engine_error, build_app
from step20_http_serve.async_llm import AsyncLLM, Delta
from step20_http_serve.protocol import Float
from step20_http_serve.server import arm_fault_marker

from .engine import AdvLLM, bad_words_to_ids, check_token_ids
from .params import SamplingParams


class PenaltyFields(BaseModel):
    """The fields, typed as strictly as lesson 20's; put first among the bases so they win."""
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0)] | None = None
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None
    bad_words: list[Annotated[StrictStr, Field(min_length=1)]] | None = None

    def check_penalties(self) -> None:
        """Accepted: the engine of this lesson applies them."""

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        base: LLMSamplingParams = super().sampling_params(max_tokens, logprobs)
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return SamplingParams(**fields, presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=self.logit_bias or None, bad_words=self.bad_words or None)


class CompletionRequest(PenaltyFields, protocol.CompletionRequest):
    pass


class ChatCompletionRequest(PenaltyFields, protocol.ChatCompletionRequest):
    pass


class AdvAsyncLLM(AsyncLLM):
    """What only the served model knows: bad words -> its token ids, bias ids inside its vocabulary."""

    def generate(self, requests: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[Delta]:
        ready = []
        for ids, sp in requests:
            if isinstance(sp, SamplingParams):
                if sp.bad_words and sp.bad_words_token_ids is None:
                    sp.bad_words_token_ids = bad_words_to_ids(self.tokenizer, sp.bad_words)
                try:
                    check_token_ids(sp, self.vocab_size)
                except ValueError as e:              # before any request is queued: a clean 400
                    raise _engine_error(e) from e
            ready.append((ids, sp))
        return super().generate(ready)


def build_server(model: str | None = None, *, served_model_name: str | None = None, dtype: str = "auto",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 enforce_eager: bool = False, max_body_bytes: int = 16 * 2**20, threaded: bool = True,
                 fault_marker: str | None = None, policy: FaultPolicy | None = None,
                 tensor_parallel_size: int = 1, launch=None):
    """Lesson 20's build_server with AdvLLM and these request classes: (app, AdvAsyncLLM)."""
    llm = AdvLLM(model, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 kv_cache_bytes=kv_cache_bytes, enforce_eager=enforce_eager,
                 tensor_parallel_size=tensor_parallel_size, launch=launch)
    arm_fault_marker(llm, fault_marker)
    engine = AdvAsyncLLM(llm, served_model_name, threaded, policy)
    app = build_app(engine, max_body_bytes=max_body_bytes, completion_request=CompletionRequest,
                    chat_request=ChatCompletionRequest)
    return app, engine


if __name__ == "__main__":
    main(build=build_server)
