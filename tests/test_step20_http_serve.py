"""Lesson 20: the OpenAI-compatible server, tested over real HTTP with the official client.

One live server (uvicorn in a thread, the embedded SmolLM2 in fp32, eager) serves the whole
module; the references from lesson 19's LLM are computed on the same LLM before it starts.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
from types import SimpleNamespace
from urllib.parse import urlparse

import aiohttp
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams
from step20_http_serve.api import build_app
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.server import ServerThread

MODEL = "smollm2-test"
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(smol_dir):
    llm = LLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=16)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    ref = SimpleNamespace(
        text=llm.generate(PROMPT, greedy, use_tqdm=False)[0],
        chat=llm.chat(QUESTION, greedy, use_tqdm=False)[0],
        sampled=llm.generate(PROMPT, SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8), use_tqdm=False)[0])
    engine = AsyncLLM(llm, MODEL)
    try:
        with ServerThread(build_app(engine, max_body_bytes=BODY_LIMIT)) as url:
            yield SimpleNamespace(url=url, engine=engine, ref=ref, llm=llm,
                                  client=OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60))
    finally:
        engine.shutdown()


def _raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """One plain HTTP request: bodies the openai client would never send (bad JSON, huge)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _metrics(url: str) -> dict[str, float]:
    status, text = _raw(url, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value   # summed over labels (finished_reason)
    return out


# ---- the official client ------------------------------------------------------------------
def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == [MODEL]
    assert _raw(server.url, "GET", "/health")[0] == 200


def test_completion_matches_llm_generate(server):
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = server.ref.text
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream(server):
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == server.ref.text.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(server.ref.text.outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == server.ref.text.outputs[0].finish_reason


def test_chat_matches_llm_chat(server):
    ref = server.ref.chat
    r = server.client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=12,
                                              temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_n_and_seed(server):
    def ask():
        return server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2,
                                                seed=7, logprobs=0)
    a, b = ask(), ask()
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]          # same seed, same text
    assert [c.text for c in a.choices] == [o.text for o in server.ref.sampled.outputs]   # and lesson 19's
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    assert a.usage.prompt_tokens == len(server.ref.sampled.prompt_token_ids)     # counted once, not per choice
    streamed = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2,
                                                seed=7, stream=True)
    texts = ["", ""]
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in a.choices]


def test_stop_string(server):
    full = server.ref.text.outputs[0].text
    stop = full.strip().split()[1]                    # the second word of the greedy answer
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    choice = r.choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens < len(server.ref.text.outputs[0].token_ids)
    chunks = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_logprobs(server):
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert chosen == pytest.approx(max(top.values()))                      # greedy: the chosen is the best
    assert "".join(lp.tokens) == r.choices[0].text
    c = server.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token and entry.bytes == list(entry.token.encode())


# ---- client mistakes ----------------------------------------------------------------------
def _bad_requests(max_len: int):
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    C, H = "/v1/completions", "/v1/chat/completions"
    return [  # (path, body, status, field named)
        (C, b'{"prompt": "hi", ', 400, "JSON"),
        (C, b"[1, 2]", 400, "body"),
        (C, {"model": MODEL}, 400, "prompt"),
        (H, {"model": MODEL}, 400, "messages"),
        (C, ok | {"prompt": 5}, 400, "prompt"),
        (C, ok | {"max_tokens": "4"}, 400, "max_tokens"),
        (C, ok | {"max_tokens": 0}, 400, "max_tokens"),
        (C, ok | {"max_tokens": -3}, 400, "max_tokens"),
        (C, ok | {"temperature": -0.5}, 400, "temperature"),
        (C, ok | {"top_p": 0}, 400, "top_p"),
        (C, ok | {"top_p": 1.5}, 400, "top_p"),
        (C, ok | {"top_k": -2}, 400, "top_k"),
        (C, ok | {"n": 0}, 400, "n"),
        (C, ok | {"stream": "yes"}, 400, "stream"),
        (C, ok | {"stop": 5}, 400, "stop"),
        (C, ok | {"model": "gpt-5"}, 404, "model"),
        (H, chat | {"model": "gpt-5"}, 404, "model"),
        (H, chat | {"messages": []}, 400, "messages"),
        (H, chat | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        (H, chat | {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        (C, ok | {"prompt": [1] * (max_len + 10)}, 400, "prompt"),
        (C, ok | {"prompt": [1] * 100, "max_tokens": max_len}, 400, "max_tokens"),
        (C, ok | {"logprobs": 6}, 400, "logprobs"),
        (H, chat | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (H, chat | {"top_logprobs": 2}, 400, "top_logprobs"),
        (C, ok | {"prompt": [1, 2, 10**7]}, 400, "prompt"),
        (C, ok | {"stream_options": {"include_usage": True}}, 400, "stream_options"),
        (C, ok | {"frequency_penalty": 0.5}, 400, "frequency_penalty"),
        (C, b'{"prompt": "' + b"x" * (BODY_LIMIT + 10) + b'"}', 413, "body"),
        ("/v1/nowhere", ok, 404, "Not Found"),
    ]


def test_client_mistakes_are_4xx_naming_the_field(server):
    before = _metrics(server.url)
    cases = _bad_requests(server.engine.max_model_len)
    assert len(cases) >= 15
    for path, body, status, field in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, raw = _raw(server.url, "POST", path, data)
        assert got == status, (path, body if not isinstance(body, bytes) else body[:40], raw[:300])
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert field in err["message"], (field, err)
        if field not in ("JSON", "body", "Not Found"):
            assert err["param"] == field
    after = _metrics(server.url)            # nothing reached the engine
    assert after["vllm:num_requests_waiting"] == after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
    with pytest.raises(BadRequestError):
        server.client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(NotFoundError):
        server.client.chat.completions.create(model="gpt-5", messages=QUESTION)


# ---- many clients, some leaving ------------------------------------------------------------
async def _one_client(url: str, i: int, rng: random.Random) -> str:
    """One client: streaming or not, completions or chat; it may hang up before the answer
    starts ("early": queued or in prefill) or after a few chunks. Returns "done" or "left"."""
    chat, stream = i % 2 == 1, i % 8 != 0
    leave = rng.choice([None, None, "early", 1, 3] if stream else [None, "early"])   # None: stay to the end
    # A client that leaves asks for far more than the test waits for: unless its request is
    # really aborted, the server cannot be idle at the end.
    max_tokens = rng.randint(4, 24) if leave is None else 1000
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "stream": stream,
            "ignore_eos": True} | ({"stream_options": {"include_usage": True}} if stream else {})
    body |= {"messages": [{"role": "user", "content": f"Count to {i}."}]} if chat else {"prompt": f"Story {i}:"}
    url += "/v1/chat/completions" if chat else "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession() as session:
        if leave == "early":
            try:
                resp = await asyncio.wait_for(session.post(url, json=body, timeout=timeout), rng.uniform(0.01, 0.5))
            except asyncio.TimeoutError:
                return "left"                                 # the connection closes with the session
            resp.close()
            return "left"
        resp = await session.post(url, json=body, timeout=timeout)
        assert resp.status == 200, await resp.text()
        if not stream:
            assert (await resp.json())["usage"]["completion_tokens"] == max_tokens
            return "done"
        seen, usage = 0, None
        async for line in resp.content:
            line = line.strip()
            if not line:
                continue
            if leave is not None and seen >= leave:
                resp.close()                                  # drop the connection mid-stream
                return "left"
            seen += 1
            if line == b"data: [DONE]":
                assert usage is not None and usage["completion_tokens"] == max_tokens
                return "done"
            usage = json.loads(line[len(b"data: "):]).get("usage") or usage
        raise AssertionError("stream ended without [DONE]")


def test_concurrent_clients_with_disconnects_free_everything(server):
    rng = random.Random(0)

    async def main():
        return await asyncio.gather(*(_one_client(server.url, i, rng) for i in range(64)))

    before = _metrics(server.url)
    outcomes = asyncio.run(main())
    assert len(outcomes) == 64 and {"done", "left"} == set(outcomes)
    deadline = time.monotonic() + 20                 # aborts land at the engine's next step
    while True:
        m = _metrics(server.url)
        idle = m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        if idle and m["vllm:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0, "KV blocks still held after every client finished or left"
    assert not server.engine.front._live and not server.engine.front._adds
    finished = m["vllm:request_success_total"] - before.get("vllm:request_success_total", 0)
    assert finished == outcomes.count("done")                # the others were aborted, not finished


# ---- /metrics ----------------------------------------------------------------------------
def test_metrics_parse_and_move(server):
    before = _metrics(server.url)
    names = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
             "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count"}
    assert names <= set(before)
    r = server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})     # vLLM's extension field
    after = _metrics(server.url)
    assert r.usage.completion_tokens == 5
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == r.usage.prompt_tokens
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"vllm:{h}_count"] == before[f"vllm:{h}_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 4


@pytest.mark.slow
def test_python_m_serves_with_the_engine_in_the_main_thread_and_stops_on_sigint(smol_dir):
    """`python -m step20_http_serve`: the engine loop in the main thread, uvicorn in a helper
    thread; a request is answered, /health is 200, and Ctrl+C (SIGINT) ends it cleanly."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:                         # a free port (released just before use)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "step20_http_serve", "--model", str(smol_dir), "--port", str(port),
                             "--dtype", "fp32", "--enforce-eager", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        body = json.dumps({"model": str(smol_dir), "prompt": "The capital of France is", "max_tokens": 5,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["text"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
