"""Building and running the server: the LLM, the async layer, the app, uvicorn.

`python -m step20_http_serve` runs the engine loop in the main thread and uvicorn beside it
(`serve` with an unthreaded front end: lesson 18's thread_cost.py measured oneDNN's matmuls
~2.5x slower from a second thread). Tests and run.py need
the server next to their own code instead: `ServerThread` runs uvicorn in a thread on a socket
bound beforehand (port 0: the OS picks a free port, so parallel runs never collide) and stops
it cleanly on exit.
"""
from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Callable

# The exit code of a server whose engine died (lesson 18's faults.py): not 0, so a supervisor
# (systemd, Kubernetes, a shell loop) restarts it; 3, so a log tells it from a crash (1) or a kill.
EXIT_ENGINE_DEAD = 3
DRAIN_S = 1.0            # after death: in-flight answers (503s) go out, then the server stops

import uvicorn

from step18_benchmark.faults import FaultPlan, FaultPolicy, inject_faults, prompt_contains
from step19_real_model.llm import LLM
from step20_http_serve.api import build_app
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.dashboard import end_page_streams


def build_server(model: str | None = None, *, served_model_name: str | None = None, dtype: str = "auto",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 enforce_eager: bool = False, max_body_bytes: int = 16 * 2**20, threaded: bool = True,
                 fault_marker: str | None = None, policy: FaultPolicy | None = None,
                 tensor_parallel_size: int = 1, launch=None, llm_class: type = LLM,
                 async_llm_class: type = AsyncLLM, make_app: Callable = build_app):
    """(the FastAPI app, its AsyncLLM); call the AsyncLLM's shutdown() when done serving.
    threaded=False: `serve` must run it (the engine loop in the calling thread).
    fault_marker: a lesson and soak tool: the step holding a prompt with this text raises.
    policy: when step faults make the engine dead (default: 3 within 60 s).
    llm_class, async_llm_class, make_app(engine, max_body_bytes=...): what a later lesson swaps
    in (its LLM, its async layer, its request classes or routes); the rest stays this lesson's."""
    llm = llm_class(model, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    kv_cache_bytes=kv_cache_bytes, enforce_eager=enforce_eager,
                    tensor_parallel_size=tensor_parallel_size, launch=launch)
    arm_fault_marker(llm, fault_marker)
    engine = async_llm_class(llm, served_model_name, threaded, policy)
    return make_app(engine, max_body_bytes=max_body_bytes), engine


def arm_fault_marker(llm, marker: str | None) -> None:
    """With a marker: the engine step that holds a prompt containing it raises (faults.py)."""
    if marker:
        inject_faults(llm.engine, FaultPlan(when=prompt_contains(marker, llm.tokenizer.decode)))


class ServerThread:
    """with ServerThread(app) as url: ... -- uvicorn serving `app` at url until the block ends."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        # uvicorn installs no signal handlers outside the main thread: stopping is should_exit.
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        end_page_streams(self.app)
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def serve(app, host: str, port: int, log_level: str = "info", front=None) -> None:
    """uvicorn in the foreground; with an unthreaded front end (lesson 18's `threaded=False`),
    uvicorn runs in a helper thread and this thread runs the engine loop until uvicorn stops.
    Ctrl+C / SIGTERM then only ask uvicorn to stop (a flag, set between bytecodes), so no
    engine step is ever interrupted halfway; in-flight requests finish, as uvicorn's own
    graceful shutdown lets them. If the engine dies (lesson 18's faults.py), uvicorn is asked
    to stop DRAIN_S later; the caller then exits with EXIT_ENGINE_DEAD."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if front is None or front.threaded:
        server.run()
        return

    def stop(signum, frame) -> None:
        end_page_streams(app)
        server.should_exit = True

    def on_dead(dead) -> None:                   # in the engine thread; uvicorn answers 503s meanwhile
        print(f"{dead}; stopping in {DRAIN_S:g} s (exit code {EXIT_ENGINE_DEAD})", flush=True)
        threading.Timer(DRAIN_S, stop, args=(None, None)).start()
    front.on_dead = on_dead
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        front.drive(server.run)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
