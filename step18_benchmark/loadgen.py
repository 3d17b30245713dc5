"""The load generator: requests sent at Poisson arrival times, each one timed token by token.

    arrival times    gaps drawn from an exponential distribution with mean 1/rate (a Poisson
                     process: what `vllm bench serve --request-rate` sends); rate = inf sends
                     every request at once (the offline-throughput limit, as a server sees it)
    one request      sent at its time whatever the others are doing, so a slow server builds
                     a queue; its record keeps when it was sent and when each token arrived
    a sender         where requests go: this process's engine through the async front end
                     (`engine_sender`), or any OpenAI-compatible server (`http_sender`), so
                     lesson 20's server and a real vLLM are measured by the same code
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from tqdm import tqdm

from step06_sampler.params import SamplingParams
from step18_benchmark.frontend import AsyncEngine
from step18_benchmark.metrics import RequestRecord, ServingResult, SLO, summarize


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


Sender = Callable[[Request], Awaitable[RequestRecord]]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of n requests is sent."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def engine_sender(front: AsyncEngine) -> Sender:
    async def send(req: Request) -> RequestRecord:
        rec = RequestRecord(prompt_len=len(req.prompt_ids), start=time.perf_counter())
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
        try:
            async for _ in front.generate(req.prompt_ids, params):
                rec.token_times.append(time.perf_counter())     # when the client sees it
        except Exception as e:  # noqa: BLE001 - a failed request is a record, not a crash
            rec.success, rec.error = False, repr(e)
        rec.output_len, rec.end = len(rec.token_times), time.perf_counter()
        return rec
    # A front end without its own engine thread is driven from this thread (sweep uses it).
    send.drive = front.drive if not front.threaded else None
    return send


def http_sender(base_url: str, model: str) -> Sender:
    """Each request on its own connection (as vLLM's benchmark client does): no request waits
    for another's connection, and every event loop gets sessions of its own."""
    import aiohttp

    from step18_benchmark.openai_client import completions_request

    async def send(req: Request) -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            return await completions_request(session, base_url, model, req.prompt_ids, req.max_tokens,
                                             prompt_len=len(req.prompt_ids))
    return send


async def run_load(send: Sender, requests: list[Request], rate: float, seed: int = 0,
                   desc: str = "") -> tuple[list[RequestRecord], float]:
    """Send `requests` at Poisson times; wait for all; (records, seconds from first send to last token)."""
    times = arrival_times(len(requests), rate, seed)
    bar = tqdm(total=len(requests), desc=desc or f"rate {rate:g}/s", unit="req", leave=False,
               disable=None)                                  # None: only on a terminal

    async def one(req: Request, at: float, start: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        rec = await send(req)
        bar.update(1)
        return rec

    start = time.perf_counter()
    records = await asyncio.gather(*(one(r, t, start) for r, t in zip(requests, times)))
    bar.close()
    end = max((r.end for r in records), default=start)
    return list(records), end - start


def sweep(send: Sender, requests: list[Request], rates: list[float], seed: int = 0,
          slo: SLO | None = None) -> list[tuple[float, ServingResult, list[RequestRecord]]]:
    """The same requests at each rate, one rate after the other."""
    out = []
    drive = getattr(send, "drive", None)     # engine_sender of an unthreaded front end
    for rate in rates:
        def load(rate=rate):
            return asyncio.run(run_load(send, requests, rate, seed))
        records, duration = drive(load) if drive else load()
        out.append((rate, summarize(records, duration, slo), records))
    return out
