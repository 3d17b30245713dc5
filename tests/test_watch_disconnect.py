"""A page that closes mid-stream leaves nothing behind: no viewer queue on the hub, no server
thread (the standard library's server of lessons 09-19), no asyncio task (lesson 20's FastAPI
routes, served by uvicorn). Counted before, during and after, with a real engine stepping."""
import asyncio
import socket
import threading
import time
import urllib.request

import pytest
import torch
from fastapi import FastAPI

from minivllm_support.watch import Watcher, WatchServer
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingEngine
from step20_http_serve.dashboard import mount_dashboard
from step20_http_serve.server import ServerThread


pytestmark = pytest.mark.usefixtures("one_thread")     # tiny steps: one thread is fastest beside others

@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    model = load_model(tiny_qwen3_dir, torch.float32)
    bpb = KVPool.bytes_per_block(model.config, 16, torch.float32)
    return PrefixCachingEngine(model, PagedSchedulerConfig(kv_cache_bytes=64 * bpb, max_num_seqs=4))


def _open_stream(base: str) -> socket.socket:
    host, port = base.split("//")[1].split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
    return sock


def _read_events(sock: socket.socket, n: int) -> bytes:
    """Read until `n` data lines arrived (each wait bounded by the socket's timeout)."""
    got = b""
    while got.count(b"data: {") < n:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream"
        got += chunk
    return got


def _wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _step_a_few(engine) -> None:
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6))


def test_stdlib_server_a_closed_page_leaves_no_thread_and_no_queue(engine):
    watcher = Watcher()
    watcher.attach(engine)
    try:
        with WatchServer(watcher) as url:
            page = urllib.request.urlopen(url, timeout=10).read()
            assert b"<canvas" in page and b"app.js" in page
            before = set(threading.enumerate())
            sock = _open_stream(url)
            assert _wait_for(lambda: watcher.hub.num_viewers == 1)
            assert len(set(threading.enumerate()) - before) == 1        # one thread serves the stream
            _read_events(sock, 1)                                       # the state at once (idle)
            _step_a_few(engine)
            _read_events(sock, 2)                                       # and the steps, mid-stream
            sock.close()
            assert _wait_for(lambda: watcher.hub.num_viewers == 0), "the viewer's queue stayed"
            assert _wait_for(lambda: set(threading.enumerate()) <= before), "the stream's thread stayed"
            _step_a_few(engine)                                         # no viewer: nothing published
    finally:
        watcher.close()
    assert "step" not in engine.__dict__


def test_fastapi_routes_a_closed_page_leaves_no_task_and_no_queue(engine):
    app = FastAPI()
    watcher = mount_dashboard(app, engine)
    try:
        server = ServerThread(app)
        with server as base:
            page = urllib.request.urlopen(base + "/dashboard", timeout=10).read()
            assert b"<canvas" in page
            assert b"EventSource" in urllib.request.urlopen(base + "/dashboard/app.js", timeout=10).read()
            loop = server.server.servers[0].get_loop()          # the event loop uvicorn runs in

            def tasks() -> int:
                async def count() -> int:
                    return len(asyncio.all_tasks()) - 1                 # less this counting task
                return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=10)
            before = tasks()
            sock = _open_stream(base)
            assert _wait_for(lambda: watcher.hub.num_viewers == 1)
            assert tasks() > before                                     # the response's task(s)
            _read_events(sock, 1)
            _step_a_few(engine)
            _read_events(sock, 2)
            sock.close()
            assert _wait_for(lambda: watcher.hub.num_viewers == 0), "the viewer's queue stayed"
            assert _wait_for(lambda: tasks() <= before), f"tasks left: {tasks()} > {before}"
    finally:
        watcher.close()



def test_stopping_lesson_20s_server_ends_an_open_page_stream_at_once(engine):
    app = FastAPI()
    watcher = mount_dashboard(app, engine)
    try:
        server = ServerThread(app)
        with server as base:
            sock = _open_stream(base)
            _read_events(sock, 1)
            start = time.monotonic()
        stopped_s = time.monotonic() - start          # uvicorn waits up to 5 s for open responses
        sock.close()
        assert not server.thread.is_alive() and stopped_s < 3, stopped_s
        assert watcher.hub.num_viewers == 0
    finally:
        watcher.close()
