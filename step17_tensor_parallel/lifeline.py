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
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1                       # <linux/prctl.h>


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
