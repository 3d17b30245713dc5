"""Watch the engine work: a live page of its queues, KV blocks and prefix cache.

    engine.step() -> Watcher (a snapshot, only if a page is open) -> Hub (a bounded queue per page)
                  -> server-sent events -> static/dashboard.html draws it

Lessons 09-19: `--watch [PORT]` on their run.py (add_watch_argument + watch_engines below).
Lesson 20 mounts the same hub in its FastAPI app at /dashboard. Nothing here imports a lesson:
the engine is read by duck typing (snapshot.py says which attributes).
"""
from __future__ import annotations

import argparse
import atexit
import time

from minivllm_support.watch.hub import Hub
from minivllm_support.watch.server import WatchServer
from minivllm_support.watch.watcher import Watcher

DEFAULT_PORT = 8001

__all__ = ["Hub", "Watcher", "WatchServer", "add_watch_argument", "watch_engines"]


def add_watch_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--watch", nargs="?", type=int, const=DEFAULT_PORT, default=None, metavar="PORT",
                        help=f"serve a live page of the engine (queues, KV blocks, prefix cache) at "
                             f"http://127.0.0.1:PORT/dashboard while this runs (default port {DEFAULT_PORT})")
    parser.add_argument("--watch-wait", type=float, default=30.0, metavar="S",
                        help="with --watch: wait up to S seconds for the page to open before starting")
    return parser


def watch_engines(engine_class: type, args: argparse.Namespace) -> Watcher | None:
    """With --watch: every `engine_class` built from here on is watched, the page is served on a
    daemon thread until the program ends, and this waits (at most --watch-wait s) for a page."""
    if getattr(args, "watch", None) is None:
        return None
    watcher = Watcher()
    watcher.watch_class(engine_class)
    server = WatchServer(watcher, port=args.watch)
    url = server.start()

    def stop() -> None:
        watcher.close()
        server.stop()
    atexit.register(stop)
    wait = max(0.0, args.watch_wait)
    print(f"watching the engine at {url} (waiting up to {wait:g} s for the page to open)", flush=True)
    deadline = time.monotonic() + wait
    while not watcher.hub.has_viewers and time.monotonic() < deadline:
        time.sleep(0.1)
    print("page open: starting" if watcher.hub.has_viewers else "no page opened: starting anyway", flush=True)
    return watcher
