"""Lesson 20's OpenAI-compatible server with this lesson's processors in its request fields.

    request JSON                               SamplingParams (params.py)
    min_tokens  >= 0, <= max_tokens      ->    min_tokens           (vLLM's extension)
    allowed_token_ids [ids]              ->    allowed_token_ids    (vLLM's extension)
    logit_bias {"id": bias}              ->    logit_bias {id: bias} (OpenAI; JSON keys are strings)

logprobs / top_logprobs are lesson 19's: computed from the model's raw logits, so what the
processors did to a step does not show in them (vLLM's default). A client can therefore ask
for allowed_token_ids and still read how likely the model found each allowed token, and which
tokens it would have preferred. The rest of the server is lesson 20's, unchanged:

    python -m advanced.adv17_logits_processors.server --model PATH --port 8000   (lesson 20's flags)
"""
from __future__ import annotations

from typing import Annotated, AsyncIterator

from pydantic import BaseModel, Field

from step18_benchmark.faults import FaultPolicy
from step19_real_model.params import SamplingParams as LLMSamplingParams
from step20_http_serve import protocol
from step20_http_serve.__main__ import main
from step20_http_serve.api import _engine_error, build_app
from step20_http_serve.async_llm import AsyncLLM, Delta
from step20_http_serve.protocol import APIError, Float, Int
from step20_http_serve.server import arm_fault_marker

from .engine import ProcessorLLM, check_token_ids
from .params import SamplingParams


class ProcessorFields(BaseModel):
    """The fields, typed as strictly as lesson 20's; put first among the bases so they win."""
    min_tokens: Annotated[Int, Field(ge=0)] | None = None
    allowed_token_ids: Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)] | None = None
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None

    def check_penalties(self) -> None:
        """logit_bias is a processor here; the penalties are still refused (advanced lesson 02 has them)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(f"{name}: not supported by this server (only 0)", name)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        base: LLMSamplingParams = super().sampling_params(max_tokens, logprobs)
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return SamplingParams(**fields, min_tokens=self.min_tokens or 0, allowed_token_ids=self.allowed_token_ids,
                              logit_bias=self.logit_bias or None)


class CompletionRequest(ProcessorFields, protocol.CompletionRequest):
    pass


class ChatCompletionRequest(ProcessorFields, protocol.ChatCompletionRequest):
    pass


class ProcessorAsyncLLM(AsyncLLM):
    """Ids inside the served model's vocabulary, checked before anything is queued: a clean 400."""

    def generate(self, requests: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[Delta]:
        for _, sp in requests:
            try:
                check_token_ids(sp, self.vocab_size)
            except ValueError as e:
                raise _engine_error(e) from e
        return super().generate(requests)


def build_server(model: str | None = None, *, served_model_name: str | None = None, dtype: str = "auto",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 enforce_eager: bool = False, max_body_bytes: int = 16 * 2**20, threaded: bool = True,
                 fault_marker: str | None = None, policy: FaultPolicy | None = None,
                 tensor_parallel_size: int = 1, launch=None):
    """Lesson 20's build_server with ProcessorLLM and these request classes: (app, ProcessorAsyncLLM)."""
    llm = ProcessorLLM(model, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       kv_cache_bytes=kv_cache_bytes, enforce_eager=enforce_eager,
                       tensor_parallel_size=tensor_parallel_size, launch=launch)
    arm_fault_marker(llm, fault_marker)
    engine = ProcessorAsyncLLM(llm, served_model_name, threaded, policy)
    app = build_app(engine, max_body_bytes=max_body_bytes, completion_request=CompletionRequest,
                    chat_request=ChatCompletionRequest)
    return app, engine


if __name__ == "__main__":
    main(build=build_server)
