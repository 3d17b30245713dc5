"""`make soak`: start the server, drive it with a mixed, misbehaving load for a while, then check it held.

    python step20_http_serve/soak.py --minutes 1 --concurrency 64      # what CI runs
    make soak MINUTES=5 CONCURRENCY=256

The server runs as its own process (`python -m step20_http_serve --fault-marker ...`), as a user
would start it, tied to this one (lesson 17's lifeline.popen_tied): if the soak is killed, so is
the server. Each client loops until the time is up, picking one kind of request at random:

    completion     greedy completion          -> 200, text, finish_reason length|stop
    chat_stream    streamed chat              -> SSE chunks, then [DONE]
    stream_cut     streamed, hangs up after 1-3 chunks (the server must abort and free its blocks)
    n2             completion with n=2, seed  -> 200 with two choices
    stop           completion with stop=["."] -> 200, no "." in the text
    malformed      bad JSON / missing field / max_tokens < 1 -> 4xx with OpenAI's error JSON
and one more task sends a prompt holding the fault marker every `--fault-every-s` seconds: the
step that holds it raises (lesson 18's faults.py), so it gets a 500 naming the fault, and so may
the requests that shared its step; everything else must go on.

While it runs, RSS and /metrics are sampled; at the end the server must be back to idle (no
request running or waiting, KV usage 0), /health 200, RSS growth after warm-up under
`--rss-growth-pct`, every answer the expected one, and SIGTERM must stop it with exit code 0.
Prints one table; exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from minivllm_support.cli import machine
from step17_tensor_parallel.lifeline import popen_tied

MARKER = "zebra-fault-please"
PROMPTS = ["The capital of France is", "Write one sentence about the sea.", "List three colours:",
           "Explain what a KV cache is.", "Count from one to five:", "Say hello in French."]
KINDS = ["completion", "chat_stream", "stream_cut", "n2", "stop", "malformed"]
MODEL = "soak"


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)
    ok: Counter = field(default_factory=Counter)
    fault: Counter = field(default_factory=Counter)       # ended by the injected fault, as allowed
    bad: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def unexpected(self, kind: str, what: str) -> None:
        self.bad[kind] += 1
        if len(self.examples) < 8:
            self.examples.append(f"{kind}: {what[:300]}")


def is_fault_error(body: dict | None) -> bool:
    """The error JSON of a request whose step raised (OpenAI's shape, naming the injected fault)."""
    err = (body or {}).get("error") or {}
    return isinstance(err, dict) and "injected fault" in str(err.get("message", ""))


async def post(session: aiohttp.ClientSession, url: str, body, raw: bool = False):
    data = body if raw else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        try:
            payload = await r.json(content_type=None)
        except (json.JSONDecodeError, aiohttp.ContentTypeError):
            payload = None
        return r.status, payload


async def stream(session: aiohttp.ClientSession, url: str, body: dict, cut_after: int | None):
    """(status, events, saw_done, error_event) of a streamed request; cut_after: hang up after that
    many data events."""
    events, done, error = [], False, None
    async with session.post(url, json=body) as r:
        if r.status != 200:
            return r.status, [], False, await r.json(content_type=None)
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj
            events.append(obj)
            if cut_after is not None and len(events) >= cut_after:
                break                                           # leaving the block closes the connection
    return 200, events, done, error


async def one_request(session, base: str, kind: str, rng: random.Random, tally: Tally) -> None:
    prompt = rng.choice(PROMPTS)
    n_tokens = rng.randint(4, 24)
    tally.sent[kind] += 1
    try:
        if kind in ("completion", "n2", "stop"):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0}
            if kind == "n2":
                body.update(n=2, temperature=0.8, seed=rng.randrange(1000))
            if kind == "stop":
                body["stop"] = ["."]
            status, out = await post(session, f"{base}/v1/completions", body)
            if status == 500 and is_fault_error(out):
                tally.fault[kind] += 1
                return
            choices = (out or {}).get("choices") or []
            good = status == 200 and len(choices) == (2 if kind == "n2" else 1) and all(
                c.get("finish_reason") in ("length", "stop") and isinstance(c.get("text"), str) for c in choices)
            if good and kind == "stop":
                good = "." not in choices[0]["text"]
            (tally.ok.update([kind]) if good else tally.unexpected(kind, f"{status} {out}"))
        elif kind in ("chat_stream", "stream_cut"):
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n_tokens,
                    "temperature": 0, "stream": True}
            cut = rng.randint(1, 3) if kind == "stream_cut" else None
            status, events, done, error = await stream(session, f"{base}/v1/chat/completions", body, cut)
            if (status == 500 and is_fault_error(error)) or (status == 200 and error is not None and is_fault_error(error)):
                tally.fault[kind] += 1
            elif status == 200 and error is None and (done or cut is not None) and events:
                tally.ok[kind] += 1
            else:
                tally.unexpected(kind, f"status {status}, done={done}, error={error}, {len(events)} events")
        else:                                                    # malformed: three flavours
            flavour = rng.randrange(3)
            body = ('{"model": "soak", "prompt": ' if flavour == 0 else
                    {"model": MODEL} if flavour == 1 else {"model": MODEL, "prompt": prompt, "max_tokens": 0})
            status, out = await post(session, f"{base}/v1/completions", body, raw=flavour == 0)
            err = (out or {}).get("error")
            good = 400 <= status < 500 and isinstance(err, dict) and err.get("message")
            (tally.ok.update([kind]) if good else tally.unexpected(kind, f"{status} {out}"))
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        tally.unexpected(kind, f"{type(e).__name__}: {e}")


async def fault_sender(session, base: str, every_s: float, deadline: float, tally: Tally) -> None:
    await asyncio.sleep(min(10.0, every_s / 2))
    while time.monotonic() < deadline:
        tally.sent["fault"] += 1
        body = {"model": MODEL, "prompt": f"Please repeat: {MARKER}", "max_tokens": 8, "temperature": 0}
        status, out = await post(session, f"{base}/v1/completions", body)
        if status == 500 and is_fault_error(out):
            tally.ok["fault"] += 1
        else:
            tally.unexpected("fault", f"{status} {out}")
        await asyncio.sleep(every_s)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def metrics(session, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("vllm:")] = float(value)
    return out


async def sampler(session, base: str, pid: int, deadline: float, samples: list) -> None:
    while time.monotonic() < deadline:
        m = await metrics(session, base)
        samples.append((time.monotonic(), rss_mib(pid), m.get("num_requests_running", -1), m.get("num_requests_waiting", -1)))
        await asyncio.sleep(2.0)


async def drive(base: str, pid: int, args) -> tuple[Tally, list, dict, int]:
    tally, samples = Tally(), []
    deadline = time.monotonic() + args.minutes * 60
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def client(i: int) -> None:
            rng = random.Random(args.seed * 100_003 + i)
            while time.monotonic() < deadline:
                await one_request(session, base, rng.choice(KINDS), rng, tally)
        tasks = [asyncio.create_task(client(i)) for i in range(args.concurrency)]
        tasks.append(asyncio.create_task(fault_sender(session, base, args.fault_every_s, deadline, tally)))
        tasks.append(asyncio.create_task(sampler(session, base, pid, deadline, samples)))
        await asyncio.gather(*tasks)
        end, final = time.monotonic() + 60, {}
        while time.monotonic() < end:                         # the server settles: aborted streams, last steps
            final = await metrics(session, base)
            if final.get("num_requests_running") == 0 and final.get("num_requests_waiting") == 0 \
                    and final.get("kv_cache_usage_perc") == 0:
                break
            await asyncio.sleep(0.5)
        async with session.get(f"{base}/health") as r:
            health = r.status
    return tally, samples, final, health


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64, help="clients, each with one request in flight")
    p.add_argument("--fault-every-s", type=float, default=45.0,
                   help="seconds between fault-marker requests (the server dies at 3 faults within 60 s)")
    p.add_argument("--rss-growth-pct", type=float, default=10.0, help="allowed RSS growth after warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="serve with the compiled decode step")
    args = p.parse_args()
    if args.minutes <= 0 or args.concurrency < 1 or args.fault_every_s <= 0:
        p.error("--minutes, --concurrency and --fault-every-s must be positive")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "step20_http_serve", "--port", str(port), "--served-model-name", MODEL,
           "--fault-marker", MARKER, "--log-level", "warning"] + ([] if args.compile else ["--enforce-eager"])
    print(f"machine: {machine()}\nserver: {' '.join(cmd[1:])}\n"
          f"load: {args.concurrency} clients for {args.minutes:g} min, a fault-marker request every "
          f"{args.fault_every_s:g} s", flush=True)
    proc = popen_tied(cmd, stdin=subprocess.DEVNULL)      # a killed soak takes its server with it
    try:
        wait_healthy(base, proc)
        t0 = time.monotonic()
        tally, samples, final, health = asyncio.run(drive(base, proc.pid, args))
        seconds = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return report(args, tally, samples, final, health, exit_code, seconds)


def report(args, tally: Tally, samples: list, final: dict, health: int, exit_code: int, seconds: float) -> int:
    print(f"\n{'kind':12s} {'sent':>7s} {'as expected':>12s} {'fault 500':>10s} {'unexpected':>11s}")
    for kind in KINDS + ["fault"]:
        print(f"{kind:12s} {tally.sent[kind]:7d} {tally.ok[kind]:12d} {tally.fault[kind]:10d} {tally.bad[kind]:11d}")
    total = sum(tally.sent.values())
    print(f"{'all':12s} {total:7d} {sum(tally.ok.values()):12d} {sum(tally.fault.values()):10d} "
          f"{sum(tally.bad.values()):11d}   ({total / seconds:.1f} requests/s over {seconds:.0f} s)")
    warm = [s for s in samples if s[0] - samples[0][0] >= min(30.0, args.minutes * 60 / 4)] if samples else []
    rss0, rss1 = (warm[0][1], samples[-1][1]) if warm else (float("nan"), float("nan"))
    growth = 100 * (rss1 - rss0) / rss0 if warm else float("nan")
    peak_running = max((s[2] for s in samples), default=0)
    checks = {
        "every answer as expected": sum(tally.bad.values()) == 0,
        "every fault-marker request got its 500": tally.ok["fault"] == tally.sent["fault"] > 0,
        "afterwards: 0 running, 0 waiting, KV usage 0": final.get("num_requests_running") == 0
        and final.get("num_requests_waiting") == 0 and final.get("kv_cache_usage_perc") == 0,
        "afterwards: /health 200": health == 200,
        f"RSS growth after warm-up <= {args.rss_growth_pct:g}%": warm and growth <= args.rss_growth_pct,
        "SIGTERM: exit code 0": exit_code == 0,
    }
    print(f"\nRSS after warm-up {rss0:.0f} MiB, at the end {rss1:.0f} MiB ({growth:+.1f}%); "
          f"most requests running at once: {peak_running:.0f}")
    print(f"final /metrics: running {final.get('num_requests_running')}, waiting {final.get('num_requests_waiting')}, "
          f"KV usage {final.get('kv_cache_usage_perc')}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    for e in tally.examples:
        print(f"  unexpected: {e}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
