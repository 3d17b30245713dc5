"""GET /dashboard and /dashboard/events: the live page of the engine, on this lesson's server.

The watcher, the hub and the page are minivllm_support.watch's (lessons 09-19 serve them with
the standard library's HTTP server); here the same hub feeds FastAPI routes:

    engine thread: step() -> Watcher (snapshot only while a page is open) -> Hub.publish
    event loop:    one task per open page: await its AsyncViewer -> "data: {...}\\n\\n"

A page that closes: Starlette cancels the response's task, the generator's `finally` takes the
viewer off the hub; no queue, no task is left (tests/test_watch_disconnect.py counts them).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from minivllm_support.watch import Watcher
from minivllm_support.watch.server import HEARTBEAT_S, static_file


def mount_dashboard(app: FastAPI, engine) -> Watcher:
    """Hook `engine` (its step() gains a check for open pages) and add the page's routes."""
    watcher = Watcher()
    watcher.attach(engine)
    app.state.watcher = watcher

    for path in ("/dashboard", "/dashboard/app.js", "/dashboard/style.css"):
        app.add_api_route(path, _page_file(path), methods=["GET"], include_in_schema=False)

    @app.get("/dashboard/events", include_in_schema=False)
    async def events() -> StreamingResponse:
        return StreamingResponse(_stream(watcher), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return watcher


def end_page_streams(app) -> None:
    """Before the server stops: end every open page's stream (uvicorn's graceful shutdown waits
    for open responses, and an event stream never ends by itself). A page then shows "disconnected"."""
    watcher = getattr(getattr(app, "state", None), "watcher", None)
    if watcher is not None:
        watcher.hub.close()


def _page_file(path: str):
    body, ctype = static_file(path)

    async def page() -> Response:
        return Response(body, media_type=ctype.split(";")[0])
    return page


async def _stream(watcher: Watcher) -> AsyncIterator[str]:
    # Subscribed inside the generator, so its `finally` runs for every viewer it made.
    viewer = watcher.hub.subscribe(asyncio.get_running_loop())
    try:
        watcher.on_subscribe(viewer)
        while not viewer.closed:
            data = await viewer.next(HEARTBEAT_S)
            if data is None:
                watcher.refresh_if_idle()
                yield ": still here\n\n"
            else:
                yield f"data: {data}\n\n"
    finally:
        watcher.hub.unsubscribe(viewer)
