"""The page in a real browser, against this lesson's server, in the middle of a run that shares
blocks and preempts: the browser test's driver and the README's screenshot.

    python -m step20_http_serve.watch_demo step20_http_serve/dashboard.png
    python -m step20_http_serve.watch_demo bench        what the page costs a step (watch_bench.py)

starts the server in this process (the embedded SmolLM2, eager, a KV pool of KV_BLOCKS blocks),
opens /dashboard in headless Chromium, sends BURST completions that share a PREFIX_TOKENS-token
prompt prefix and together need more blocks than the pool has, takes the screenshot once the
page shows a shared block and a preemption at the same time, waits for the end, and prints
what the page showed next to the block manager's own books.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from minivllm_support.watch.browser import browser_missing, open_browser, page_state, save_small_png, wait_until
from step20_http_serve.server import ServerThread, build_server

KV_BLOCKS = 40             # 16-token blocks: 640 token slots for BURST requests of ~170 tokens each
BURST = 8
PREFIX_TOKENS = 64         # four full blocks every request shares
MAX_TOKENS = 100


@dataclass
class DemoResult:
    screenshot_bytes: int | None = None
    during: dict = field(default_factory=dict)     # page state when the screenshot was taken
    end: dict = field(default_factory=dict)        # page state once every request finished
    books: dict = field(default_factory=dict)      # the block manager's, at the end
    answers: int = 0


def _complete(base: str, prompt: list[int], answers: list) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answers.append(json.loads(resp.read())["usage"]["completion_tokens"])


def kv_bytes(llm_model_dir=None) -> int:
    """Bytes of KV_BLOCKS blocks of the embedded model in the dtype the server picks."""
    from minivllm_support.cpu import auto_dtype
    from minivllm_support.models import resolve_model
    from step04_transformer.config import ModelConfig
    from step12_paged_attention.kv_pool import KVPool
    cfg = ModelConfig.from_pretrained(resolve_model(llm_model_dir))
    return KV_BLOCKS * KVPool.bytes_per_block(cfg, 16, auto_dtype())


def run_demo(png: Path | None, timeout_s: float = 240.0) -> DemoResult:
    result = DemoResult()
    app, engine = build_server(None, served_model_name="demo", enforce_eager=True, max_num_seqs=BURST,
                               max_num_batched_tokens=256, kv_cache_bytes=kv_bytes())
    bm = engine.llm.engine.scheduler.block_manager
    driver = None
    threads: list[threading.Thread] = []
    try:
        with ServerThread(app) as base:
            driver = open_browser()
            driver.get(base + "/dashboard")
            wait_until(driver, lambda s: s["status"] == "live", 30)
            prefix = [(7 * i) % 3000 + 100 for i in range(PREFIX_TOKENS)]
            for i in range(BURST):
                prompt = prefix + [4000 + 10 * i + j for j in range(6)]
                threads.append(threading.Thread(target=_complete, args=(base, prompt, answers := []), daemon=True))
                threads[-1].answers = answers
                threads[-1].start()
            result.during = wait_until(driver, lambda s: s["preemptions"] > 0 and s["shared_cells"]
                                       and sum(r["queue"] == "running" for r in s["rows"]) >= 2, timeout_s)
            if png is not None:
                result.screenshot_bytes = save_small_png(driver, png)
            for t in threads:
                t.join(timeout=timeout_s)
            result.answers = sum(len(t.answers) for t in threads)
            result.end = wait_until(driver, lambda s: s["finished"] >= BURST and s["kv"]["used"] == 0, 30)
            result.books = {"num_blocks": bm.num_blocks, "free": bm.num_free_blocks,
                            "used": bm.num_blocks - bm.num_free_blocks, "cached": len(getattr(bm, "hash_of", {}))}
            driver.quit()                     # the page's stream ends before the server stops
            driver = None
    finally:
        if driver is not None:
            driver.quit()
        engine.shutdown()
        engine.llm.close()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from step20_http_serve.watch_bench import main as bench
        bench(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m step20_http_serve.watch_demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("png", nargs="?", type=Path, default=Path("step20_http_serve/dashboard.png"),
                   help="where the screenshot goes ('bench' instead: the cost bench)")
    args = p.parse_args(argv)
    if (why := browser_missing()) is not None:
        print(f"skipped, no screenshot: {why}")
        return 0
    r = run_demo(args.png)
    d, e = r.during, r.end
    print(f"screenshot: {args.png} ({r.screenshot_bytes} bytes) at step {d.get('step')}: "
          f"{sum(x['queue'] == 'running' for x in d['rows'])} running, "
          f"{sum(x['queue'] == 'waiting' for x in d['rows'])} waiting, preemptions {d['preemptions']}, "
          f"shared blocks {len(d['shared_cells'])} (ref counts {sorted(set(d['shared_cells']))})")
    print(f"answers: {r.answers} of {BURST}; page at the end: step {e['step']}, finished {e['finished']}, "
          f"preemptions {e['preemptions']}, most sharing ref {e['max_ref']}, KV used {e['kv']['used']} cached "
          f"{e['kv']['cached']} free {e['kv']['free']} of {e['kv']['total']}; block manager: {r.books}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
