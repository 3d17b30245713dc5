"""Lesson 17: no worker outlives the process that started it (lifeline.py). If this breaks, a
killed launcher leaves workers holding memory and answering their peers, and a killed torchrun
agent leaves a rank that keeps the engine looking healthy."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.processes import kill_tree, still_running, torchrun_agents

PARENT = """
import multiprocessing as mp, os, subprocess, sys, time
from step17_tensor_parallel.lifeline import die_with_parent, popen_tied

def child(arm):
    if arm == "1":
        die_with_parent()
    print(os.getpid(), flush=True)              # armed (or not, for the control): the test may kill us
    time.sleep(120)

if __name__ == "__main__":
    how, arm = sys.argv[1:]
    if how == "process":                        # a worker, as lesson 17 starts them
        mp.get_context("spawn").Process(target=child, args=(arm,)).start()
    else:                                       # a program, as the soak starts lesson 20's server
        start = popen_tied if arm == "1" else subprocess.Popen
        start([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"])
    time.sleep(120)
"""


def _child_of_killed_parent(tmp_path, how: str, arm: str) -> psutil.Process:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), how, arm], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))   # printed once the child is armed
        parent.send_signal(signal.SIGKILL)                 # the parent alone, not its group
        parent.wait(10)
        return child
    except BaseException:
        kill_tree(parent)
        raise


@pytest.mark.parametrize("how", ["process", "popen"])
def test_a_child_dies_with_the_process_that_started_it(tmp_path, how):
    """process: a worker that called die_with_parent(); popen: a program started by popen_tied."""
    child = _child_of_killed_parent(tmp_path, how, "1")
    alive = still_running([child], 5)
    for p in alive:
        p.kill()
    assert not alive, f"the child ({how}) outlived its killed parent"


@pytest.mark.parametrize("how", ["process", "popen"])
def test_without_the_lifeline_the_child_would_outlive_it(tmp_path, how):
    """The control: the same child untied survives, so the test above tests something."""
    child = _child_of_killed_parent(tmp_path, how, "0")
    try:
        time.sleep(0.5)                                    # time enough for a tied child to go
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        psutil.wait_procs([child], timeout=5)


def test_popen_tied_asks_the_program_too(monkeypatch):
    """Where prctl is missing (macOS) the program is asked by the environment; lesson 20's server
    honours it. Here: the variable reaches the child."""
    from step17_tensor_parallel.lifeline import LIFELINE_ENV, popen_tied
    monkeypatch.delenv(LIFELINE_ENV, raising=False)
    out = popen_tied([sys.executable, "-c", f"import os; print(os.environ.get({LIFELINE_ENV!r}))"],
                     stdout=subprocess.PIPE, text=True).communicate(timeout=60)[0]
    assert out.strip() == "1"


KILLED_AGENT_SCRIPT = """
import sys, torch
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.engine import TPEngine, WorkerFailed
from step17_tensor_parallel.node import run_torchrun_worker
folder = sys.argv[1]
run_torchrun_worker(folder, 2, torch.float32, timeout_s=20.0)      # rank 1: serve, then exit here
config = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=1 << 20)
with TPEngine(folder, config, tensor_parallel_size=2, dtype=torch.float32, threads_per_rank=1) as engine:
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
    print("READY", flush=True)
    try:
        while True:
            engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    except WorkerFailed as e:
        print("FAILED", str(e).splitlines()[0], flush=True)
"""


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in proc.stdout], daemon=True).start()
    return q


def _wait_for(q: queue.Queue, prefix: str, timeout_s: float) -> str:
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith(prefix):
            return line
    pytest.fail(f"no {prefix!r} line within {timeout_s} s:\n{''.join(seen)}")


@pytest.mark.slow
def test_killing_node_1s_torchrun_agent_ends_its_worker_and_fails_rank_0(tiny_qwen3_dir, tmp_path):
    agents = torchrun_agents(tmp_path, KILLED_AGENT_SCRIPT, str(tiny_qwen3_dir))
    spawned: list[psutil.Process] = []
    try:
        out0 = _lines(agents[0])
        _wait_for(out0, "READY", 90)
        spawned = [c for a in agents for c in psutil.Process(a.pid).children(recursive=True)]
        workers = psutil.Process(agents[1].pid).children(recursive=True)
        assert workers, "node 1's agent has no worker"
        os.kill(agents[1].pid, signal.SIGKILL)                 # the agent alone, as a scheduler would
        alive = still_running(workers, 10)
        assert not alive, f"node 1's worker outlived its agent: {[p.pid for p in alive]}"
        failed = _wait_for(out0, "FAILED", 60)
        assert "step failed" in failed or "connection lost" in failed, failed   # a WorkerFailed, not a hang
        rank0 = psutil.Process(agents[0].pid).children(recursive=True)
        alive = still_running(rank0, 30)   # rank 0 ends; its agent then waits out
        assert not alive, "rank 0 did not end"               # torchrun's exit barrier for node 1's
    finally:
        for p in spawned:                  # torchrun puts workers in sessions of their own: kill them by pid
            if p.is_running():
                p.kill()
        for a in agents:
            kill_tree(a)
