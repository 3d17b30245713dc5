"""Lesson 18: serving metrics checked against numbers computed by hand, and the streaming OpenAI
client checked against a small aiohttp server started in the test (normal streams and every
way a request can fail)."""
from __future__ import annotations

import asyncio
import json
import math
import socket
from typing import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from step18_benchmark.metrics import SLO, RequestRecord, Stats, percentile_stats, summarize
from step18_benchmark.openai_client import completions_request, list_models


# ---- metrics on synthetic timestamps ---------------------------------------------------------
def _rec(start: float, times: list[float], end: float, prompt: int, out: int | None = None,
         success: bool = True) -> RequestRecord:
    return RequestRecord(prompt_len=prompt, start=start, token_times=list(times),
                         output_len=len(times) if out is None else out, end=end, success=success)


# ttft 100 ms, gaps 200 + 300, e2el 700, tpot (700 - 100) / 2 = 300
A = _rec(0.0, [0.1, 0.3, 0.6], end=0.7, prompt=10)
# ttft 500, gaps 100 x 3, e2el 800, tpot (800 - 500) / 3 = 100
B = _rec(1.0, [1.5, 1.6, 1.7, 1.8], end=1.8, prompt=20)
# one token: ttft 50, e2el 50, no TPOT, no gap
C = _rec(2.0, [2.05], end=2.05, prompt=5)
# 3 chunks carrying 5 tokens: ttft 200, gaps 50 + 50, e2el 400, tpot (400 - 200) / 4 = 50
D = _rec(3.0, [3.2, 3.25, 3.3], end=3.4, prompt=15, out=5)
# failed: its huge latencies and tokens must appear nowhere
FAILED = _rec(0.0, [9.0], end=9.5, prompt=100, success=False)


def _stats(s: Stats) -> tuple[float, ...]:
    return (s.mean, s.median, s.p90, s.p99)


def test_request_record_properties():
    assert A.ttft == pytest.approx(0.1) and A.e2el == pytest.approx(0.7)
    assert A.itl == pytest.approx([0.2, 0.3]) and A.tpot == pytest.approx(0.3)
    assert D.tpot == pytest.approx(0.05)                  # per token (5), not per chunk (3)
    assert C.tpot is None and C.itl == []                 # the first token is TTFT's
    nothing = RequestRecord(prompt_len=3, start=1.0, end=2.0, success=False)
    assert nothing.ttft is None and nothing.tpot is None and nothing.itl == []


def test_summary_matches_hand_computed_values():
    r = summarize([A, B, C, D, FAILED], duration_s=5.0)
    assert (r.completed, r.failed, r.duration_s) == (4, 1, 5.0)
    assert (r.total_input_tokens, r.total_output_tokens) == (50, 13)
    assert (r.request_throughput, r.output_throughput, r.total_token_throughput) == pytest.approx((0.8, 2.6, 12.6))
    assert r.goodput is None
    # TTFT 100, 500, 50, 200 -> sorted 50 100 200 500; p90 at rank 0.9 * 3 = 2.7: 200 + 0.7 * 300
    assert _stats(r.ttft) == pytest.approx((212.5, 150, 410, 491))
    assert r.ttft.std == pytest.approx(math.sqrt((162.5**2 + 112.5**2 + 12.5**2 + 287.5**2) / 4))
    # TPOT 300, 100, 50 (C has none) -> p90 at rank 1.8: 100 + 0.8 * 200
    assert _stats(r.tpot) == pytest.approx((150, 100, 260, 296))
    # ITL pools every gap: 200 300 | 100 100 100 | 50 50 -> p90 at rank 5.4: 200 + 0.4 * 100
    assert _stats(r.itl) == pytest.approx((900 / 7, 100, 240, 294))
    # E2EL 700, 800, 50, 400 -> sorted 50 400 700 800
    assert _stats(r.e2el) == pytest.approx((487.5, 550, 770, 797))


def test_goodput_counts_requests_meeting_every_slo():
    # A breaks the TPOT limit (300 > 200), B the TTFT limit (500 > 300); C (no TPOT) and D pass
    r = summarize([A, B, C, D, FAILED], duration_s=5.0, slo=SLO(ttft_ms=300, tpot_ms=200))
    assert r.goodput == pytest.approx(2 / 5)
    assert summarize([A, B, C, D], 5.0, SLO(e2el_ms=600)).goodput == pytest.approx(2 / 5)
    assert summarize([A, B, C, D], 5.0, SLO(ttft_ms=1000, tpot_ms=1000, e2el_ms=1000)).goodput == pytest.approx(0.8)
    assert summarize([A, B], 5.0, SLO()).goodput is None        # no limit given, nothing to check
    exact = _rec(0.0, [0.25, 0.5], end=0.5, prompt=1)           # exactly representable: 250 ms
    assert summarize([exact], 1.0, SLO(ttft_ms=250)).goodput == 1.0   # at the limit meets it


def test_empty_and_all_failed_runs_give_zeros():
    assert percentile_stats([]) == Stats(0.0, 0.0, 0.0, 0.0, 0.0)
    s = percentile_stats([0.010])
    assert (s.mean, s.median, s.p90, s.p99, s.std) == pytest.approx((10, 10, 10, 10, 0))
    empty = summarize([], 0.0)
    assert (empty.completed, empty.failed, empty.request_throughput, empty.goodput) == (0, 0, 0.0, None)
    assert empty.ttft == empty.itl == Stats(0.0, 0.0, 0.0, 0.0, 0.0)
    dead = summarize([FAILED], 1.0, SLO(ttft_ms=10_000))
    assert (dead.completed, dead.failed, dead.total_input_tokens, dead.goodput) == (0, 1, 0, 0.0)
    assert dead.e2el.mean == 0.0


def test_result_serializes_and_prints():
    r = summarize([A, B, C, D, FAILED], 5.0, SLO(ttft_ms=300))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["completed"] == 4 and d["ttft"]["p90"] == pytest.approx(410) and d["goodput"] == pytest.approx(0.6)
    text = r.table()
    for needle in ("Successful requests:", "Failed requests:", "Request goodput (req/s):",
                   "P90 TTFT (ms):", "410.00", "Mean ITL (ms):", "P99 E2EL (ms):"):
        assert needle in text
    assert "goodput" not in summarize([A], 1.0).table()


# ---- the OpenAI client against a local server -------------------------------------------------
SEEN: list[dict] = []                          # request bodies the fake server received


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    """The fake server; the "model" field of the request picks how it behaves."""
    body = await request.json()
    SEEN.append(body)
    scenario = body["model"]
    if scenario == "bad":
        return web.json_response({"error": {"message": "bad prompt", "code": 400}}, status=400)
    if scenario == "slow":
        await asyncio.sleep(1.0)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = {"normal": 5, "packed": 2, "nousage": 3}.get(scenario, 2)
    for i in range(n):
        await asyncio.sleep(0.02 if scenario == "normal" else 0)
        await resp.write(_event({"choices": [{"index": 0, "text": "ab" if scenario == "packed" else f" t{i}"}]}))
    if scenario == "cut":
        request.transport.close()              # the server dies mid-stream
        return resp
    await resp.write({"malformed": b"data: {not json\n\n",
                      "error": _event({"error": {"message": "engine died"}})}.get(scenario, b": ping\n\n"))
    await resp.write(_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    if scenario != "nousage":
        await resp.write(_event({"choices": [], "usage": {"completion_tokens": 4 if scenario == "packed" else n}}))
    if scenario != "nodone":
        await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m1", "object": "model"}, {"id": "m2"}]})


def _with_server(fn: Callable[[str, aiohttp.ClientSession], Awaitable]) -> object:
    """Start the fake server on a free port, run fn(base_url, session), stop everything."""
    async def main() -> object:
        app = web.Application()
        app.router.add_post("/v1/completions", _completions)
        app.router.add_get("/v1/models", _models)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                return await fn(f"http://127.0.0.1:{port}", session)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def _request(model: str, timeout_s: float = 10) -> RequestRecord:
    return _with_server(lambda base, s: completions_request(s, base, model, [1, 2, 3], 5, prompt_len=3,
                                                            timeout_s=timeout_s))


def test_client_times_a_normal_stream():
    SEEN.clear()
    rec = _request("normal")
    assert rec.success and rec.error == "" and rec.output_len == 5 and rec.prompt_len == 3
    assert len(rec.token_times) == 5                       # the empty finish chunk is no token
    assert all(b > a for a, b in zip(rec.token_times, rec.token_times[1:]))
    assert rec.ttft >= 0.015 and rec.end >= rec.token_times[-1] and rec.tpot > 0
    assert SEEN[-1] == {"model": "normal", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}


def test_client_counts_tokens_from_usage_else_chunks():
    packed = _request("packed")                # 2 chunks, usage says 4 tokens
    assert packed.success and (len(packed.token_times), packed.output_len) == (2, 4)
    plain = _request("nousage")
    assert plain.success and plain.output_len == 3


def test_client_reports_failures_without_raising():
    bad = _request("bad")
    assert not bad.success and "HTTP 400" in bad.error and "bad prompt" in bad.error
    nodone = _request("nodone")
    assert not nodone.success and "[DONE]" in nodone.error and len(nodone.token_times) == 2
    cut = _request("cut")
    assert not cut.success and cut.error and cut.output_len == 2
    malformed = _request("malformed")
    assert not malformed.success and "malformed" in malformed.error
    died = _request("error")
    assert not died.success and "engine died" in died.error
    slow = _request("slow", timeout_s=0.2)
    assert not slow.success and "timed out" in slow.error and 0.15 < slow.e2el < 0.9


def test_client_reports_a_refused_connection():
    with socket.socket() as sock:              # a port that was free a moment ago: nobody listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def go() -> RequestRecord:
        async with aiohttp.ClientSession() as s:
            return await completions_request(s, f"http://127.0.0.1:{port}", "m", "hi", 4, prompt_len=1)
    rec = asyncio.run(go())
    assert not rec.success and "Connect" in rec.error and rec.token_times == []


def test_list_models_returns_ids():
    assert _with_server(lambda base, s: list_models(s, base)) == ["m1", "m2"]
    assert _with_server(lambda base, s: list_models(s, base + "/v1/")) == ["m1", "m2"]
