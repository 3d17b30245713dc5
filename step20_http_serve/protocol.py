"""The requests the server accepts, as pydantic models, and the errors it answers with.

Field names and meanings are OpenAI's (plus vLLM's extensions top_k, min_p, ignore_eos,
stop_token_ids, ...). Types are strict: `"max_tokens": "16"` or `"n": true` is a client's
mistake and gets a 400 naming the field, not a silent conversion. Fields the engine has no
lesson for (penalties, logit_bias, tools) are refused when set to anything but "off", so a
client never believes it got a behaviour it did not get; unknown fields are ignored, as vLLM
ignores them.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from step19_real_model.params import SamplingParams

Int = StrictInt
Float = Annotated[float, Field(strict=True)]     # strict float still accepts a JSON integer


class APIError(Exception):
    """An error answered as OpenAI's JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    """What completions and chat share: the model, sampling, stopping, streaming."""
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None           # vLLM extension; -1 or 0: off
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None    # vLLM extension
    n: Annotated[Int, Field(ge=1, le=128)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    seed: Int | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Accepted only when they ask for nothing: the engine has no penalties or biases (yet).
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict | None = None
    user: StrictStr | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return v

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed when stream is true", "stream_options")
        self.check_penalties()

    def check_penalties(self) -> None:
        """Refused here; advanced lesson 02's requests accept them (it overrides this)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(f"{name}: not supported by this server (only 0)", name)
        if self.logit_bias:
            raise APIError("logit_bias: not supported by this server", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; OpenAI's defaults where the request left a field out."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=max_tokens, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, seed=self.seed, n=self.n, stop=self.stop, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Common):
    prompt: Any = Field(...)
    max_tokens: Annotated[Int, Field(ge=1)] | None = 16          # OpenAI's default for completions
    logprobs: Annotated[Int, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str] | list[list[int]]:
        """One of OpenAI's four shapes, normalised to a list of prompts (text or token ids)."""
        is_ids = lambda x: isinstance(x, list) and x and all(type(t) is int for t in x)  # noqa: E731
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if is_ids(v):
                return [v]
            if all(is_ids(p) for p in v):
                return v
        raise ValueError("must be a string, a list of strings, a non-empty list of token ids "
                         "or a list of such lists")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError("echo: not supported by this server", "echo")
        if self.suffix:
            raise APIError("suffix: not supported by this server", "suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str:
        """A string, or OpenAI's list of parts of which we take the text ones (joined)."""
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in v):
            return "\n".join(p["text"] for p in v)
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')

    def as_dict(self) -> dict:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    tools: list | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", "top_logprobs")
        if self.tools:
            raise APIError("tools: function calling is not supported by this server", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError("response_format: only {\"type\": \"text\"} is supported", "response_format")

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens is OpenAI's current name; max_tokens the deprecated one."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic error list -> one 400 naming the first offending field, e.g. messages[0].role."""
    err = errors[0]
    param = ""
    for part in err.get("loc", ()):
        if part == "body":
            continue
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "a required field is missing"
    if param == "messages" and err.get("type") == "too_short":
        msg = "must be a non-empty list of messages"
    return APIError(f"{param or 'body'}: {msg}", param or None)
