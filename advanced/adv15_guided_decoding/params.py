"""SamplingParams with vLLM's `structured_outputs`: at most one constraint per request.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={...schema...}))
    SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\\d{3}-\\d{4}"))
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))

One nested object rather than flat guided_json / guided_regex / guided_choice fields (vLLM's
older spelling, which lesson 20's server still accepts, see server.py): the constraint is one
thing with several forms, and "exactly one of them" is checked in one place. Every form
becomes a regex (`to_regex`), checked here, so a bad schema or pattern fails when the params
are made, naming what is wrong, and never in the middle of a batched step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from advanced.adv02_sampling.params import SamplingParams as AdvSamplingParams

from .dfa import compile_regex
from .json_schema import choice_regex, json_object_regex, schema_regex


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None           # a JSON schema (or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False                # any JSON object (response_format json_object)

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice") if getattr(self, n) is not None] + \
                (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, json_object; got {given}")
        compile_regex(self.to_regex())                 # a bad constraint fails here, named

    def to_regex(self) -> str:
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("structured_outputs.regex must be a non-empty string")
            return self.regex
        if self.choice is not None:
            return choice_regex(list(self.choice))
        if self.json_object:
            return json_object_regex()
        schema: Any = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        return schema_regex(schema)

    def __hash__(self) -> int:                     # dicts inside: hash the canonical text
        return hash(self.to_regex())


@dataclass
class SamplingParams(AdvSamplingParams):
    """Lesson 19's params with advanced 02's penalties and a structured_outputs constraint."""
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        so = self.structured_outputs
        if isinstance(so, dict):
            so = self.structured_outputs = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"SamplingParams.structured_outputs must be StructuredOutputsParams or None, got {so!r}")
        if so is not None and self.ignore_eos:     # EOS is how a guided answer says "complete"
            raise ValueError("SamplingParams.ignore_eos cannot be combined with structured_outputs")


def constraint_of(params) -> StructuredOutputsParams | None:
    """Works for any engine params: only this lesson's SamplingParams carry a constraint."""
    return getattr(params, "structured_outputs", None)
