"""A worker ends with the process that started it.

A worker process whose launcher dies (rank 0 killed, a node launcher killed, torchrun's agent
killed by a cluster scheduler) would otherwise run on, re-parented to init, holding its share of
the model and its KV pool, and answering its peers as if nothing had happened. torch 2.13's
torchrun starts each worker in a session of its own, so signals sent to the agent's process
group do not reach it either.

On Linux the kernel can do this for us: `prctl(PR_SET_PDEATHSIG, SIGKILL)` asks for SIGKILL when
the thread that started this process ends (its process dying ends it). Elsewhere (macOS) a
daemon thread polls the parent's pid once a second. Either way, a parent that was already gone
before we asked (we were re-parented already) ends us at once.

A program we start with subprocess (the soak's server, vLLM's server for the benchmark) is tied
the same way by `popen_tied`: on Linux the request is made in the child between fork and exec,
so it holds for any program; elsewhere the child is asked by an environment variable, which
lesson 20's server honours.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1                       # <linux/prctl.h>
LIFELINE_ENV = "MINIVLLM_DIE_WITH_PARENT"  # "1": the program should call die_with_parent() itself


def die_with_parent(poll_s: float = 1.0) -> str:
    """Arrange for this process to end when its parent does. Returns how: "prctl" or "poll"."""
    parent = os.getppid()
    how = "poll"
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            how = "prctl"
    if how == "poll":
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            os._exit(1)
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if parent == 1 or os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    return how


def popen_tied(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, ...) whose process ends when this one does (see the module's note)."""
    env = dict(popen_kwargs.pop("env", None) or os.environ)
    env[LIFELINE_ENV] = "1"
    if sys.platform.startswith("linux"):
        parent = os.getpid()

        def tie() -> None:                      # runs in the child, after fork, before exec
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:          # we died in between: do not start at all
                os._exit(1)
        popen_kwargs["preexec_fn"] = tie
    return subprocess.Popen(cmd, env=env, **popen_kwargs)


def honour_lifeline_env() -> None:
    """For a program's entry point: die with the parent if the one that started us asked."""
    if os.environ.get(LIFELINE_ENV) == "1":
        die_with_parent()
