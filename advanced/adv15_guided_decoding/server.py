"""Lesson 20's OpenAI-compatible server (with advanced 02's penalties) and guided decoding.

    request JSON                                           StructuredOutputsParams
    response_format {"type": "json_object"}          ->   json_object=True      (OpenAI)
    response_format {"type": "json_schema",
                     "json_schema": {"schema": {...}}} ->  json={...}            (OpenAI)
    structured_outputs {"json"|"regex"|"choice": ...} ->   the same fields       (vLLM)
    guided_json / guided_regex / guided_choice        ->   json / regex / choice (vLLM's older names)

At most one of them per request. Every form is compiled to a DFA while the request is parsed,
so a schema or pattern this lesson cannot handle is a 400 naming the problem, before anything
reaches the engine. The rest is lesson 20's server, unchanged:

    python -m advanced.adv15_guided_decoding.server --model PATH --port 8000   (lesson 20's flags)
"""
from __future__ import annotations

from functools import partial

from typing import Any

from pydantic import BaseModel, StrictStr

from advanced.adv02_sampling import server as adv02
from advanced.adv02_sampling.server import AdvAsyncLLM
from step20_http_serve.__main__ import main
from step20_http_serve.api import build_app
from step20_http_serve.protocol import APIError
from step20_http_serve.server import build_server as lesson20_build_server

from .engine import GuidedLLM
from .params import SamplingParams, StructuredOutputsParams

SO_KEYS = {"json", "regex", "choice", "json_object"}


class GuidedFields(BaseModel):
    """The request fields; put first among the bases so that they win."""
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None

    def _sources(self) -> dict[str, StructuredOutputsParams]:
        found: dict[str, Any] = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError("response_format: json_schema needs {\"json_schema\": {\"name\": ..., "
                                   "\"schema\": {...}}}", "response_format")
                found["response_format"] = {"json": spec["schema"]}
            elif kind != "text":
                raise APIError("response_format: type must be text, json_object or json_schema", "response_format")
        if self.structured_outputs is not None:
            unknown = set(self.structured_outputs) - SO_KEYS
            if unknown:
                raise APIError(f"structured_outputs: unknown keys {sorted(unknown)} (known: {sorted(SO_KEYS)})",
                               "structured_outputs")
            found["structured_outputs"] = self.structured_outputs
        for name in ("json", "regex", "choice"):
            if getattr(self, "guided_" + name) is not None:
                found["guided_" + name] = {name: getattr(self, "guided_" + name)}
        if len(found) > 1:
            raise APIError(f"only one constraint per request, got {sorted(found)}", sorted(found)[1])
        out = {}
        for field, kwargs in found.items():
            try:
                out[field] = StructuredOutputsParams(**kwargs)
            except ValueError as e:                        # the schema or pattern's own problem
                raise APIError(f"{field}: {e}", field) from None
        return out

    def check_unsupported(self) -> None:
        rf, self.response_format = self.response_format, None     # lesson 20 refuses every non-text format
        try:
            super().check_unsupported()
        finally:
            self.response_format = rf
        self._sources()                                        # a bad constraint: 400 here

    def constraint(self) -> StructuredOutputsParams | None:
        return next(iter(self._sources().values()), None)     # compiled DFAs are cached: cheap again

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        base = super().sampling_params(max_tokens, logprobs)
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return SamplingParams(**fields, structured_outputs=self.constraint())


class CompletionRequest(GuidedFields, adv02.CompletionRequest):
    pass


class ChatCompletionRequest(GuidedFields, adv02.ChatCompletionRequest):
    pass


# Lesson 20's build_server with GuidedLLM and these request classes: (app, AdvAsyncLLM).
build_server = partial(lesson20_build_server, llm_class=GuidedLLM, async_llm_class=AdvAsyncLLM,
                       make_app=partial(build_app, completion_request=CompletionRequest, chat_request=ChatCompletionRequest))


if __name__ == "__main__":
    main(build=build_server)
