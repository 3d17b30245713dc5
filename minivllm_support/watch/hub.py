"""The hub: one publisher (the engine's thread), any number of viewers, each with a bounded queue.

    engine thread: hub.publish(event) --json once--> viewer 1's queue (at most `maxlen` events)
                                                 --> viewer 2's queue ...
    a viewer's server thread / asyncio task: await the next event, write it to its socket

A slow page never slows the engine: when its queue is full the oldest event is dropped (the
page then skips a step; every count on it is a running total, so nothing is lost but a bar).
A viewer is taken off the hub in a `finally` when its connection ends, so a page that closes
leaves no queue and no thread or task behind (tests/test_watch_disconnect.py counts them).
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import deque


class Viewer:
    """A viewer read from a thread (the stdlib server): a deque and a condition variable."""

    def __init__(self, maxlen: int):
        self.events: deque[str] = deque(maxlen=maxlen)
        self.dropped = 0
        self.closed = False
        self._cond = threading.Condition()

    def deliver(self, data: str) -> None:
        with self._cond:
            if len(self.events) == self.events.maxlen:
                self.dropped += 1
            self.events.append(data)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()

    def next(self, timeout: float) -> str | None:
        """The next event, or None after `timeout` seconds (or once closed)."""
        with self._cond:
            if not self.events and not self.closed:
                self._cond.wait(timeout)
            return self.events.popleft() if self.events else None


class AsyncViewer:
    """A viewer read from an asyncio task (lesson 20's FastAPI app): the engine thread hands
    each event to the viewer's event loop with call_soon_threadsafe."""

    def __init__(self, maxlen: int, loop: asyncio.AbstractEventLoop):
        self.events: deque[str] = deque(maxlen=maxlen)
        self.dropped = 0
        self.closed = False
        self.loop = loop
        self._ready = asyncio.Event()

    def _put(self, data: str | None) -> None:
        if data is None:
            self.closed = True
        else:
            if len(self.events) == self.events.maxlen:
                self.dropped += 1
            self.events.append(data)
        self._ready.set()

    def deliver(self, data: str) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, data)
        except RuntimeError:               # its loop is closed: the server is gone
            self.closed = True

    def close(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, None)
        except RuntimeError:
            self.closed = True

    async def next(self, timeout: float) -> str | None:
        if not self.events and not self.closed:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        self._ready.clear()
        return self.events.popleft() if self.events else None


class Hub:
    def __init__(self, maxlen: int = 64):
        self.maxlen = maxlen
        self._viewers: set[Viewer | AsyncViewer] = set()
        self._lock = threading.Lock()
        self.last: str | None = None        # the newest event: what a page that opens first sees
        self.published = 0

    @property
    def has_viewers(self) -> bool:
        return bool(self._viewers)          # read by the engine thread after every step: one len()

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    def subscribe(self, loop: asyncio.AbstractEventLoop | None = None) -> Viewer | AsyncViewer:
        viewer = Viewer(self.maxlen) if loop is None else AsyncViewer(self.maxlen, loop)
        with self._lock:
            self._viewers.add(viewer)
        return viewer

    def unsubscribe(self, viewer) -> None:
        with self._lock:
            self._viewers.discard(viewer)

    def publish(self, event: dict) -> None:
        data = json.dumps(event, separators=(",", ":"))
        self.last = data
        self.published += 1
        with self._lock:
            viewers = list(self._viewers)
        for v in viewers:
            v.deliver(data)

    def close(self) -> None:
        """Wake every viewer so its connection ends (the server is stopping)."""
        with self._lock:
            viewers = list(self._viewers)
        for v in viewers:
            v.close()
