"""The HTTP layer: FastAPI routes in OpenAI's shapes, SSE streaming, errors, disconnects.

    POST /v1/completions        prompt(s) -> text         stream: true -> SSE "data: {...}" chunks,
    POST /v1/chat/completions   messages -> a reply                      then "data: [DONE]"
    GET  /v1/models             the one model served
    GET  /health                200 while the engine is alive, 503 once it is dead
    GET  /metrics               Prometheus text (metrics.py)
    GET  /dashboard             the engine's queues, KV blocks, prefix cache, live (dashboard.py)

Every client mistake is a 4xx with OpenAI's error JSON; a 500 means a bug here. The body is
read and parsed by hand (not by FastAPI's signature magic) so that a size limit, invalid JSON
and each invalid field get an answer of our choosing, naming the field.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from step18_benchmark.faults import StepFailed
from step20_http_serve.async_llm import AsyncLLM, Delta
from step20_http_serve.dashboard import mount_dashboard
from step20_http_serve.metrics import CONTENT_TYPE
from step20_http_serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, validation_error)
from step20_http_serve.responses import ChatRenderer, CompletionRenderer, Renderer

CLIENT_CLOSED = 499      # nginx's code for "the client went away"; nobody reads it, logs do


def build_app(llm: AsyncLLM, max_body_bytes: int = 16 * 2**20, completion_request: type = CompletionRequest,
              chat_request: type = ChatCompletionRequest) -> FastAPI:
    """The app. A later lesson passes its own request classes (advanced lesson 02: penalties)."""
    app = FastAPI(title="mini-vllm", summary="lesson 20: an OpenAI-compatible server")
    if (engine := getattr(getattr(llm, "front", None), "engine", None)) is not None:
        mount_dashboard(app, engine)        # GET /dashboard: the engine's state, live (dashboard.py)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(e.detail), status=e.status_code, code=None if e.status_code != 404 else "not_found")
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> JSONResponse:
        err = APIError(f"internal error: {type(e).__name__}: {e}", status=500, type_="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": llm.model_name, "object": "model", "created": 0, "owned_by": "mini-vllm",
                "root": str(llm.llm.model_dir), "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _parse(completion_request, await _read_json(request, max_body_bytes), llm)
        prompts = [p if isinstance(p, list) else llm.encode(p) for p in req.prompt]
        logprobs = req.logprobs
        work = [(ids, _params(req, llm.check_prompt(ids, req.max_tokens, "prompt"), logprobs)) for ids in prompts]
        renderer = CompletionRenderer(llm, len(prompts) * req.n, sum(map(len, prompts)), req.include_usage, logprobs)
        return await _serve(request, llm.generate(work), renderer, req.stream)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = _parse(chat_request, await _read_json(request, max_body_bytes), llm)
        ids = llm.chat_ids([m.as_dict() for m in req.messages], req.chat_template_kwargs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, llm.check_prompt(ids, req.max_new_tokens, "messages"), logprobs)
        renderer = ChatRenderer(llm, req.n, len(ids), req.include_usage, logprobs)
        return await _serve(request, llm.generate([(ids, params)]), renderer, req.stream)

    return app


# ---- request in ----------------------------------------------------------------------------
async def _read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (counted, not buffered, beyond it)."""
    declared = request.headers.get("content-length", "")
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size <= limit:
            parts.append(part)
    if size > limit or (declared.isdigit() and int(declared) > limit):
        raise APIError(f"body: {size} bytes is over this server's limit of {limit}", status=413,
                       code="request_too_large")
    try:
        body = json.loads(b"".join(parts))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"body: not valid JSON ({e})", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError("body: must be a JSON object")
    return body


def _parse(model_cls, body: dict, llm: AsyncLLM):
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from e
    if req.model is not None and req.model != llm.model_name:
        raise APIError(f"model: the model `{req.model}` does not exist (this server serves "
                       f"`{llm.model_name}`)", "model", status=404, code="model_not_found")
    req.check_unsupported()
    return req


def _params(req, max_tokens: int, logprobs: int | None):
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:                        # lesson 19's own checks, should ours miss one
        raise _engine_error(e) from e


def _engine_error(e: ValueError) -> APIError:
    """A ValueError of SamplingParams or add_request: the client's mistake, named where we can."""
    field = re.search(r"SamplingParams\.(\w+)", str(e))
    return APIError(str(e), field.group(1) if field else None)


# ---- response out --------------------------------------------------------------------------
async def _serve(request: Request, deltas: AsyncIterator[Delta], renderer: Renderer, stream: bool) -> Response:
    """Run the request while watching the connection: a client that leaves cancels it, which
    aborts its engine requests and frees their KV blocks (async_llm.py)."""
    if not stream:
        async def collect() -> dict:
            async for d in deltas:
                renderer.add(d)
            return renderer.response()
        body = await _unless_disconnected(request, collect())
        return JSONResponse(body) if body is not None else Response(status_code=CLIENT_CLOSED)
    # Wait for the first token before answering 200: an error raised when the engine admits the
    # request (a prompt its KV pool could never hold) is still a proper 400, not a broken stream.
    first = await _unless_disconnected(request, anext(deltas))
    if first is None:
        return Response(status_code=CLIENT_CLOSED)
    return StreamingResponse(_sse(first, deltas, renderer), media_type="text/event-stream")


async def _sse(first: Delta, deltas: AsyncIterator[Delta], renderer: Renderer) -> AsyncIterator[str]:
    # When the client disconnects, Starlette cancels this generator where it waits: the
    # CancelledError runs through `deltas`, whose cleanup aborts the engine requests.
    try:
        for chunk in renderer.opening_chunks():
            yield _event(chunk)
        chunk = renderer.chunk(first)
        if chunk is not None:
            yield _event(chunk)
        async for d in deltas:
            chunk = renderer.chunk(d)
            if chunk is not None:
                yield _event(chunk)
        if renderer.include_usage:
            yield _event(renderer.usage_chunk())
    except Exception as e:  # noqa: BLE001 - headers are sent: an error can only go in the stream
        yield _event(APIError(f"{type(e).__name__}: {e}", status=500, type_="server_error").body())
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _unless_disconnected(request: Request, work):
    """Await `work` unless the client disconnects first (then cancel it and return None).
    Errors from `work` propagate: a ValueError from the engine becomes a 400 here."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    try:
        return task.result()
    except ValueError as e:
        raise _engine_error(e) from e
    except StepFailed as e:                        # its engine step raised; the engine went on
        raise APIError(str(e), status=500, type_="server_error") from e
    except RuntimeError as e:                      # the engine is dead or was shut down
        raise APIError(str(e), status=503, type_="server_error") from e


async def _disconnect(request: Request) -> None:
    # The body is read already, so the next ASGI message is the disconnect, whenever it comes.
    while (await request.receive())["type"] != "http.disconnect":
        pass
