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

from functools import partial

from typing import Annotated, AsyncIterator

from pydantic import BaseModel, Field, StrictStr

from step19_real_model.params import SamplingParams as LLMSamplingParams
from step20_http_serve import protocol
from step20_http_serve.__main__ import main
from step20_http_serve.api import _engine_error, build_app
from step20_http_serve.async_llm import AsyncLLM, Delta
from step20_http_serve.protocol import Float
from step20_http_serve.server import build_server as lesson20_build_server

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


# Lesson 20's build_server with AdvLLM, its async layer and these request classes: (app, AdvAsyncLLM).
build_server = partial(lesson20_build_server, llm_class=AdvLLM, async_llm_class=AdvAsyncLLM,
                       make_app=partial(build_app, completion_request=CompletionRequest, chat_request=ChatCompletionRequest))


if __name__ == "__main__":
    main(build=build_server)
