"""An all-reduce through shared memory, for ranks on one CPU machine (what vLLM's CPU backend does).

gloo sends every all-reduce over TCP through the loopback device: two system calls and a
wake-up of the other process per message. On this machine that is ~0.7 ms for 2 KB (bench.py
allreduce), and a Qwen3-0.6B decode step makes 57 of them. Processes on one machine can
instead share memory: each rank writes its partial sum into its own slot of a shared buffer,
raises its flag, waits until every flag is up, and adds the slots itself.

    shared file, mapped by every rank (unlinked as soon as all have mapped it: nothing is left
    behind, whatever happens to the processes)
      flags   [world] x 64 bytes   call number each rank has published (one cache line each)
      slots   [2][world][n] fp32   two sets, by call parity: a rank can only start call k+2
                                   (same set as k) after every rank published k+1, that is,
                                   after every rank finished reading call k

Every rank adds the slots in the same order (rank 0, 1, ...) in float32 and rounds once, so
all ranks hold the same bits, as they must: each continues the residual stream on its own.
Waiting is a spin (a core per rank is the setting where this pays); it yields the core when the
wait is long, gives up after `timeout_s` and checks that the other ranks are alive, so a dead
peer is an error within ~0.1 s, never a hang. Ordering relies on x86's store order (the data
is written before the flag, and read after it), so it is offered on x86-64 only.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
from typing import Callable

import torch
from torch import Tensor

FLAG_BYTES = 64
HEADER = 4096


def shm_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def create_file(world: int, max_elems: int) -> str:
    """Rank 0: a zeroed file big enough for the flags and both slot sets; returns its path."""
    path = f"/dev/shm/minivllm-tp-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:   # reserve the pages now: a full /dev/shm is an OSError here, not a SIGBUS later
        os.posix_fallocate(fd, 0, HEADER + 2 * world * max_elems * 4)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world: int, max_elems: int, timeout_s: float,
                 peers_alive: Callable[[], bool]):
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.flags = raw[:world * FLAG_BYTES].view(torch.int64).view(world, FLAG_BYTES // 8)[:, 0]
        self.slots = raw[HEADER:].view(torch.float32).view(2, world, max_elems)
        self.rank, self.world, self.max_elems = rank, world, max_elems
        self.timeout_s, self.peers_alive = timeout_s, peers_alive
        self.calls = 0

    def fits(self, x: Tensor) -> bool:
        return x.numel() <= self.max_elems

    def __call__(self, x: Tensor) -> Tensor:
        """Sum x over the ranks, in place (x: any float dtype, at most max_elems elements)."""
        self.calls += 1
        n, slots = x.numel(), self.slots[self.calls & 1]
        slots[self.rank, :n].copy_(x.reshape(-1))
        self.flags[self.rank] = self.calls                   # after the data: x86 keeps the order
        self._wait()
        total = slots[0, :n].clone()
        for r in range(1, self.world):
            total += slots[r, :n]
        x.copy_(total.view(x.shape))
        return x

    def _wait(self) -> None:
        spins, deadline, next_check = 0, 0.0, 0.0
        while int(self.flags.min()) < self.calls:
            spins += 1
            if spins < 200:
                continue
            os.sched_yield()                                 # more ranks than free cores: let them run
            now = time.monotonic()
            if not deadline:
                deadline, next_check = now + self.timeout_s, now
            if now >= next_check:                            # every 50 ms: is everyone still there?
                if not self.peers_alive():
                    raise RuntimeError(f"shared-memory all-reduce: a peer of rank {self.rank} is gone")
                next_check = now + 0.05
            if now > deadline:
                raise RuntimeError(f"shared-memory all-reduce: rank {self.rank} waited {self.timeout_s:.0f} s "
                                   f"for call {self.calls}; a peer stopped answering")

    def close(self) -> None:
        self.flags = self.slots = None
        try:
            self.mm.close()
        except BufferError:          # a tensor view still alive: the mapping goes when it does
            pass
