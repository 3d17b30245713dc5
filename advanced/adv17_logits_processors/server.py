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

from functools import partial

from typing import Annotated, AsyncIterator

from pydantic import BaseModel, Field

from step19_real_model.params import SamplingParams as LLMSamplingParams
from step20_http_serve import protocol
from step20_http_serve.__main__ import main
from step20_http_serve.api import _engine_error, build_app
from step20_http_serve.async_llm import AsyncLLM, Delta
from step20_http_serve.protocol import APIError, Float, Int
from step20_http_serve.server import build_server as lesson20_build_server

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


# Lesson 20's build_server with ProcessorLLM, its async layer and these request classes.
build_server = partial(lesson20_build_server, llm_class=ProcessorLLM, async_llm_class=ProcessorAsyncLLM,
                       make_app=partial(build_app, completion_request=CompletionRequest, chat_request=ChatCompletionRequest))


if __name__ == "__main__":
    main(build=build_server)
