"""Helpers for the tests of multi-process engines: the processes a test owns, our child processes,
a free port, a headless "node" started as its own process tree, and the same engine under torchrun
on loopback."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


# conftest.py puts this variable in the environment before each test, with a value naming the run
# and the test; every process the test starts inherits it, however far it strays: torchrun's
# workers and our nodes run in sessions of their own, and a worker whose parent died is
# re-parented to init, out of reach of a walk over our children but not of this mark.
MARK = "MINIVLLM_TEST_OWNER"
# Helpers of this interpreter that live as long as pytest does, whichever test started them.
LONG_LIVED = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker")


def marked(tag: str, *, and_below: bool = False) -> list[psutil.Process]:
    """Live processes (not this one) whose environment carries MARK=tag, or, with and_below,
    MARK=tag.<anything> too; less the LONG_LIVED helpers."""
    found = []
    for p in psutil.process_iter():
        try:
            value = p.environ().get(MARK) if p.pid != os.getpid() else None
            if value is None or not (value == tag or (and_below and value.startswith(tag + "."))):
                continue
            if p.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(p.cmdline()) for h in LONG_LIVED):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def reap(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL each process and wait for it (5 s at most). Returns "pid cmdline" for each."""
    named = []
    for p in procs:
        try:
            named.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)
    return named


def still_running(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of procs still running after up to timeout_s. A zombie has ended (it only waits to be
    reaped, by init when its parent died, which a container's init may do late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def our_children() -> list[psutil.Process]:
    """Live child processes of this one, less the LONG_LIVED helpers (multiprocessing's resource
    tracker, inductor's compile workers: started once, meant to live as long as we do)."""
    alive = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(p.cmdline()) for h in LONG_LIVED):
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def new_children(before: set[int], timeout_s: float = 10.0) -> set[int]:
    """Children that were not there `before` and still are after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (left := {p.pid for p in our_children()} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(module: str, folder, port: int, *flags: str) -> subprocess.Popen:
    """`python -m module` as node 1 of 2 on loopback, in its own session (its own process tree:
    it shares nothing with node 0 but the rendezvous address)."""
    cmd = [sys.executable, "-m", module, "--model", str(folder), "--dtype", "fp32", "--threads", "1",
           "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--rendezvous-timeout-s", "20", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def gone(proc: subprocess.Popen, timeout_s: float = 15.0) -> str:
    """Wait for a node process; kill its tree and fail if it overstays. Returns what it printed."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{proc.args[2]} still running after {timeout_s} s:\n{proc.communicate()[0]}")


def kill_tree(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def torchrun_agents(tmp_path: Path, script: str, *args: str) -> list[subprocess.Popen]:
    """`script` under `torchrun --nnodes 2 --nproc-per-node 1` on loopback: one agent per "node",
    each in a session of its own, output piped. The caller ends them (kill_tree)."""
    path = tmp_path / "under_torchrun.py"
    path.write_text(script)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([*torchrun, "--node-rank", str(n), str(path), *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True) for n in (0, 1)]


def torchrun_tokens(tmp_path: Path, script: str, *args: str, timeout_s: float = 90.0) -> list[list[int]]:
    """Run `script` (it prints "TOKENS <json>" on rank 0) as `torchrun --nnodes 2 --nproc-per-node 1`
    twice on loopback, one launch per "node"; both must exit 0. Returns rank 0's tokens."""
    procs = torchrun_agents(tmp_path, script, *args)
    try:
        outs = [gone(p, timeout_s) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    assert [p.returncode for p in procs] == [0, 0], outs
    line = next(x for x in outs[0].splitlines() if x.startswith("TOKENS"))
    return json.loads(line.split(" ", 1)[1])


def fake_torchrun_env(monkeypatch, rank: int, world: int) -> None:
    """torchrun's variables for one process on one node, as if it had started us (no agent)."""
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "GROUP_RANK": 0,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
