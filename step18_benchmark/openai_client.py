"""A streaming client for any OpenAI-compatible server (lesson 20's, vLLM's): one request, timed
chunk by chunk, the way `vllm bench serve` times it.

With "stream": true the server answers with Server-Sent Events, one line per event:

    data: {"choices": [{"text": " the", ...}], ...}      a chunk: one token, or a few
    data: {"choices": [], "usage": {"completion_tokens": 64, ...}}   asked for by include_usage
    data: [DONE]                                          the end

A chunk whose text is not empty is an arrival: its time is when the user would see those
characters. The usage chunk gives the true number of tokens, which is more than the number of
arrivals when a server packs several tokens in a chunk (or holds back half a UTF-8 character).
A stream that stops before [DONE] is a failure: the request did not finish, whatever arrived.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from step18_benchmark.metrics import RequestRecord


class StreamError(Exception):
    """The server answered, but not with a complete, well-formed completion stream."""


# What a single request may run into; anything else is a bug in this client and should surface.
_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError, StreamError)


def _root(base_url: str) -> str:
    """Accept both "http://host:8000" and "http://host:8000/v1", as the openai client does."""
    url = base_url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


def _payload(model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool) -> dict:
    # temperature 0 and ignore_eos make every run generate exactly max_tokens tokens, so two
    # servers are compared on the same work. A list of ints is a pre-tokenized prompt.
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": ignore_eos}


def _sse_data(raw: bytes) -> str | None:
    """The payload of a `data:` line; None for blank separators, comments and other fields."""
    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise StreamError(f"a stream line is not UTF-8: {e}") from e
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def _parse_chunk(data: str) -> tuple[str, int | None]:
    """(text of the first choice, usage.completion_tokens or None) of one JSON chunk."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"malformed chunk {data[:100]!r}: {e}") from e
    if not isinstance(chunk, dict):
        raise StreamError(f"a chunk is not a JSON object: {data[:100]!r}")
    if "error" in chunk:                       # how vLLM reports an error met mid-stream
        raise StreamError(f"error in stream: {str(chunk['error'])[:200]}")
    choices = chunk.get("choices") or []
    first = choices[0] if isinstance(choices, list) and choices else {}
    text = first.get("text") if isinstance(first, dict) else None
    usage = chunk.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return (text if isinstance(text, str) else ""), (tokens if isinstance(tokens, int) else None)


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord) -> int | None:
    """Time every text chunk into `rec` until [DONE]; return the server's token count, if given."""
    usage_tokens = None
    async for raw in resp.content:             # aiohttp splits the body into lines
        now = time.perf_counter()              # before parsing: parsing is the client's time
        data = _sse_data(raw)
        if data is None:
            continue
        if data == "[DONE]":
            rec.end = now
            return usage_tokens
        text, tokens = _parse_chunk(data)
        if text:
            rec.token_times.append(now)
        if tokens is not None:
            usage_tokens = tokens              # the last report wins (some servers send many)
    raise StreamError("the stream ended without data: [DONE] (the server stopped early)")


async def _http_error(resp: aiohttp.ClientResponse) -> StreamError:
    body = await resp.text(errors="replace")
    status = f"HTTP {resp.status}" + (f" {resp.reason}" if resp.reason else "")
    return StreamError(f"{status}: {body[:200]}")


def _describe(e: BaseException, timeout_s: float) -> str:
    # aiohttp's timeouts have an empty message; say what limit was hit instead.
    if isinstance(e, asyncio.TimeoutError):
        return f"timed out after {timeout_s:g} s ({type(e).__name__})"
    if isinstance(e, StreamError):
        return str(e)
    return f"{type(e).__name__}: {e}"


async def completions_request(session: aiohttp.ClientSession, base_url: str, model: str,
                              prompt: str | list[int], max_tokens: int, prompt_len: int,
                              ignore_eos: bool = True, timeout_s: float = 600) -> RequestRecord:
    """POST /v1/completions with stream=true and time it. A failure of this one request is a
    record with success=False and an error string, never an exception: one bad request must
    not end a benchmark of a thousand."""
    url = f"{_root(base_url)}/v1/completions"
    body = _payload(model, prompt, max_tokens, ignore_eos)
    rec = RequestRecord(prompt_len=prompt_len, start=time.perf_counter())
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise await _http_error(resp)
            usage_tokens = await _read_stream(resp, rec)
        if not rec.token_times:
            raise StreamError("the stream finished without any text: no first token to time")
        rec.output_len = usage_tokens if usage_tokens is not None else len(rec.token_times)
    except _FAILURES as e:
        rec.success, rec.error = False, _describe(e, timeout_s)
        rec.output_len, rec.end = len(rec.token_times), time.perf_counter()
    return rec


async def list_models(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 30) -> list[str]:
    """The ids GET /v1/models lists (a vLLM server serves one: the name requests must use)."""
    url = f"{_root(base_url)}/v1/models"
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: {await _http_error(resp)}")
        listing = await resp.json(content_type=None)
    return [m["id"] for m in listing.get("data", [])]
