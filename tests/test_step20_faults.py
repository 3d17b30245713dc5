"""Issue 28 over HTTP: a failed step answers its requests 500 and the server serves on; a dead
engine answers 503 and the process exits with code 3; a killed tensor-parallel worker ends in
the dead path within seconds."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from step18_benchmark.faults import EngineDead, StepFailed
from step18_benchmark.frontend import AsyncEngine
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams
from step20_http_serve.api import build_app
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.server import EXIT_ENGINE_DEAD, ServerThread, arm_fault_marker
from step20_http_serve.soak import free_port

MARKER = "zebra-fault-please"
MODEL = "faulty"


@pytest.fixture(scope="module")
def server(smol_dir):
    llm = LLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=16)
    clean = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    arm_fault_marker(llm, MARKER)
    engine = AsyncLLM(llm, MODEL)
    try:
        with ServerThread(build_app(engine)) as url:
            yield url, engine, clean
    finally:
        engine.shutdown()


async def _post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def _stream(session, url, body):
    """Every data event of a streamed request, the [DONE] included."""
    events = []
    async with session.post(url, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_a_failed_step_answers_500_and_the_server_serves_on(server):
    url, engine, clean = server

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            long = asyncio.create_task(_post(s, f"{url}/v1/completions", {
                "model": MODEL, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}))
            await asyncio.sleep(0.3)                  # it is decoding when the marker request's step comes
            bad = await _post(s, f"{url}/v1/completions",
                              {"model": MODEL, "prompt": f"say {MARKER}", "max_tokens": 4})
            return bad, await long
    (bad_status, bad_body), (long_status, long_body) = asyncio.run(go())
    assert bad_status == 500 and bad_body["error"]["type"] == "server_error"
    assert "injected fault" in bad_body["error"]["message"]
    # The other request shared the failed step (a prefill with decodes) or did not; either way
    # it is answered: 500 naming the same fault, or its full clean text.
    if long_status == 500:
        assert "injected fault" in long_body["error"]["message"]
    else:
        assert long_status == 200 and long_body["choices"][0]["text"] == clean.text
    with urllib.request.urlopen(f"{url}/health") as r:
        assert r.status == 200
    assert engine.front.error is None and engine.front.faults >= 1
    status, body = asyncio.run(_once(url, {"model": MODEL, "prompt": "The capital of France is",
                                           "max_tokens": 24, "temperature": 0}))
    assert status == 200 and body["choices"][0]["text"] == clean.text
    assert engine.llm.engine.scheduler.num_used_blocks == 0


async def _once(url, body):
    async with aiohttp.ClientSession() as s:
        return await _post(s, f"{url}/v1/completions", body)


def test_a_stream_in_a_failed_step_ends_with_an_error_event_not_a_hang(server):
    """A stream that has its first tokens (so its 200 and headers are sent) and then shares a step
    with the marker request: that step fails, so the stream ends with an error event naming the
    fault and [DONE]; the marker request, failed at its first step, gets a plain 500."""
    url, engine, _ = server
    faults = engine.front.faults

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(f"{url}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Count from one to a hundred."}],
                    "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                assert r.status == 200
                events, bad = [], None
                async for line in r.content:
                    line = line.decode().strip()
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3 and bad is None:     # decoding now: the next step takes both
                        bad = await _post(s, f"{url}/v1/completions",
                                          {"model": MODEL, "prompt": f"say {MARKER}", "max_tokens": 4})
                return events, bad
    events, (bad_status, bad_body) = asyncio.run(go())
    assert bad_status == 500 and "injected fault" in bad_body["error"]["message"]
    assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"], events[-3:]
    chunks = [json.loads(e) for e in events[:-2]]
    assert len(chunks) >= 3 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert engine.front.faults == faults + 1 and engine.front.error is None       # one fault: the server serves on


def _health(base: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.mark.slow
def test_repeated_faults_make_the_server_exit_with_code_3(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "step20_http_serve", "--port", str(port), "--enforce-eager",
                             "--dtype", "fp32", "--served-model-name", MODEL, "--fault-marker", MARKER, "--max-step-faults", "2",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while _health(base) != 200:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        statuses = [asyncio.run(_once(base, {"model": MODEL, "prompt": f"say {MARKER}", "max_tokens": 4}))[0]
                    for _ in range(2)]
        assert statuses == [500, 500]                 # each in its own failed step
        assert _health(base) in (503, None)           # dead: 503 during the drain, or already gone
        assert proc.wait(timeout=60) == EXIT_ENGINE_DEAD   # a bound against a hang, not a timing
        out = proc.stdout.read()
        assert "engine dead: 2 faults within 60 s" in out and f"exiting with code {EXIT_ENGINE_DEAD}" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_tensor_parallel_worker_ends_in_the_dead_path_within_seconds(tiny_qwen3_dir):
    import torch

    from step12_paged_attention.scheduler import PagedSchedulerConfig
    from step17_tensor_parallel.engine import TPEngine
    engine = TPEngine(tiny_qwen3_dir, PagedSchedulerConfig(max_num_seqs=4, kv_cache_bytes=16 * 2**20),
                      tensor_parallel_size=2, dtype=torch.float32, timeout_s=10)
    front = None
    try:
        workers = list(engine.workers)
        front = AsyncEngine(engine)
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        dead = []
        front.on_dead = dead.append

        async def go():
            every_one_decoding = [asyncio.Event() for _ in range(3)]

            async def one(decoding: asyncio.Event):
                try:
                    out = []
                    async for e in front.generate([1, 2, 3, 4, 5], params):
                        out.append(e.token_id)
                        decoding.set()
                    return out
                except Exception as e:  # noqa: BLE001
                    return e
            tasks = [asyncio.create_task(one(d)) for d in every_one_decoding]
            # Kill once every request has tokens (all are mid-run, 400 tokens to go), not after a
            # guessed sleep: on a fast machine they could be done by then.
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in every_one_decoding)), timeout=60)
            os.kill(workers[0].pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)   # a bound against a hang
        out = asyncio.run(go())
        assert all(isinstance(o, (StepFailed, EngineDead)) for o in out), out
        assert isinstance(front.error, EngineDead) and "closed itself" in str(front.error)
        assert dead
        assert all(not p.is_alive() for p in workers)
    finally:
        if front is not None:
            front.shutdown()
        engine.close()
