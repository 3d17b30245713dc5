"""A small threaded HTTP server for the page, from the standard library only (lessons 09-19).

    GET /  or /dashboard     the page (static/dashboard.html)
    GET /dashboard/app.js, /dashboard/style.css
    GET /dashboard/events    text/event-stream: "data: {snapshot}\n\n" after each engine step

Each connection gets a daemon thread (ThreadingHTTPServer). An event stream's thread waits on
its viewer's queue at most HEARTBEAT_S at a time; then it writes a comment line, which is how a
closed page is noticed (the write fails), and the thread unsubscribes and ends.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from minivllm_support.watch.watcher import Watcher

STATIC = Path(__file__).parent / "static"
FILES = {"/": "dashboard.html", "/dashboard": "dashboard.html", "/dashboard/": "dashboard.html",
         "/dashboard/app.js": "app.js", "/dashboard/style.css": "style.css"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
HEARTBEAT_S = 1.0


def static_file(path: str) -> tuple[bytes, str] | None:
    """(contents, content type) of the page's file at URL `path`, None if there is none."""
    name = FILES.get(path.split("?", 1)[0])
    if name is None:
        return None
    return (STATIC / name).read_bytes(), TYPES[Path(name).suffix]


def stream_events(watcher: Watcher, write, stopping: threading.Event) -> None:
    """Subscribe, then write each event until the connection or the server ends.
    `write(bytes)` raises OSError once the page is gone."""
    viewer = watcher.hub.subscribe()
    try:
        watcher.on_subscribe(viewer)
        while not stopping.is_set() and not viewer.closed:
            data = viewer.next(HEARTBEAT_S)
            if data is None:
                watcher.refresh_if_idle()
                write(b": still here\n\n")
            else:
                write(f"data: {data}\n\n".encode())
    except OSError:                          # BrokenPipe, ConnectionReset: the page closed
        pass
    finally:
        watcher.hub.unsubscribe(viewer)


class _Handler(BaseHTTPRequestHandler):
    watcher: Watcher
    stopping: threading.Event

    def log_message(self, format, *args) -> None:   # noqa: A002 - the base class's name
        pass                                         # a lesson's output stays the lesson's

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        if self.path.split("?", 1)[0] == "/dashboard/events":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()

            def write(data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()
            stream_events(self.watcher, write, self.stopping)
            self.close_connection = True
            return
        found = static_file(self.path)
        if found is None:
            self.send_error(404, "no such page (try /dashboard)")
            return
        body, ctype = found
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class WatchServer:
    """with WatchServer(watcher, port=0) as url: ... -- the page served on a daemon thread."""

    def __init__(self, watcher: Watcher, host: str = "127.0.0.1", port: int = 0):
        self.watcher = watcher
        self.stopping = threading.Event()
        handler = type("Handler", (_Handler,), {"watcher": watcher, "stopping": self.stopping})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}/dashboard"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="watch-server", daemon=True)

    def start(self) -> str:
        self.thread.start()
        return self.url

    def stop(self) -> None:
        self.stopping.set()
        self.watcher.hub.close()                    # wake every stream so its thread ends
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
