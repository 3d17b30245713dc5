"""What the live page costs the engine: step time unhooked, hooked with no page open, and with one
page reading the stream over HTTP.

    python -m step20_http_serve.watch_demo bench [--rounds 3] [--requests 16] [--max-tokens 64]

The engine is the server's (lesson 19's, eager, the embedded SmolLM2, the server's default
512 MiB KV pool). Each round runs the same workload (requests sharing a system prompt) once in
each mode, in turn, so a busy machine slows all three alike; the figure is the median step time
of each mode over every round.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

from minivllm_support.watch import Watcher, WatchServer
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams

MODES = ("unhooked", "hooked, no page", "hooked, one page")


def _reader(url: str, stop: threading.Event, got: list[int]) -> threading.Thread:
    """A page stand-in: reads the event stream over HTTP and counts the bytes."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\n\r\n")

    def read() -> None:
        try:
            while not stop.is_set():
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                got[0] += len(chunk)
                got[1] += chunk.count(b"data: ")
        except OSError:
            pass
        finally:
            sock.close()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def run_once(llm: LLM, prompts: list[list[int]], params) -> list[float]:
    engine = llm.engine
    for ids in prompts:
        engine.add_request(ids, params)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m step20_http_serve.watch_demo bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    llm = LLM(None, enforce_eager=True)
    system = llm.encode("You are a helpful assistant for a bakery in Lyon. Answer briefly. " * 3)
    prompts = [system + llm.encode(f" Question {i}: when do you open on day {i}?") for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    bm = llm.engine.scheduler.block_manager
    print(f"engine {type(llm.engine).__name__} ({llm.dtype}), KV pool {bm.num_blocks} blocks; {args.requests} requests "
          f"x {args.max_tokens} tokens, prompts {len(prompts[0])}-{max(map(len, prompts))} tokens; "
          f"{args.rounds} rounds")
    run_once(llm, prompts, params)                                  # warm-up: caches, allocator
    watcher = Watcher()
    server = WatchServer(watcher)
    url = server.start()
    steps = {m: [] for m in MODES}
    got = [0, 0]
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                stop = threading.Event()
                reader = None
                if mode != "unhooked":
                    watcher.attach(llm.engine)
                if mode == "hooked, one page":
                    reader = _reader(url, stop, got)
                    deadline = time.monotonic() + 10
                    while watcher.hub.num_viewers < 1 and time.monotonic() < deadline:
                        time.sleep(0.01)
                steps[mode] += run_once(llm, prompts, params)
                stop.set()
                if reader is not None:
                    watcher.hub.close()                             # ends its stream now
                    reader.join(timeout=10)
                    deadline = time.monotonic() + 10
                    while watcher.hub.num_viewers and time.monotonic() < deadline:
                        time.sleep(0.01)
                watcher.detach(llm.engine)
    finally:
        server.stop()
        llm.close()
    base = statistics.median(steps["unhooked"])
    print(f"{'mode':18} {'steps':>6} {'median ms':>10} {'mean ms':>9} {'vs unhooked':>12}")
    for mode in MODES:
        med = statistics.median(steps[mode])
        print(f"{mode:18} {len(steps[mode]):6d} {med * 1e3:10.2f} {statistics.fmean(steps[mode]) * 1e3:9.2f} "
              f"{(med - base) * 1e3:+11.2f}ms")
    if got[1]:
        print(f"the page received {got[1]} events, {got[0] / got[1] / 1024:.1f} KiB each on average")

