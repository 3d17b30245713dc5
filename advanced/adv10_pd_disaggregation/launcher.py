"""The launcher's handles on its engine processes: start them (pipes on one machine, lesson 17's
control sockets across two: remote.py), wait for "ready", send and receive messages, ask each
for its stats and timeline, say how one died. cluster.py's PDCluster adds the requests on top.
"""
from __future__ import annotations

import pickle
import socket
import time

import torch.multiprocessing as mp

from minivllm_support.timeline import Timeline
from step17_tensor_parallel.launch import NodeLaunch
from advanced.adv10_pd_disaggregation.process import EngineSpec, engine_main
from advanced.adv10_pd_disaggregation.remote import PDWorkerSet, admit_engines


def free_port() -> int:
    """A port nobody listens on now (the OS picks it), for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



class EngineFailed(RuntimeError):
    """An engine process the launcher cannot do without (decode, colocated) died or fell silent."""


class EngineHandles:
    """The engine processes by name ("prefill", "decode-1", ...), their connections and clocks."""
    launch: NodeLaunch | None = None

    def _init_handles(self) -> None:
        self.procs, self.conns, self.names = [], [], []
        self.proc_of: dict[str, mp.Process] = {}      # the engines on this machine
        self.offset_s: dict[str, float] = {}          # an engine's clock -> ours (another machine)
        self.worker_set: PDWorkerSet | None = None
        self.replies: list[tuple] = []

    # ---- processes -----------------------------------------------------------------------------
    def _spawn(self, role: str, spec: EngineSpec) -> None:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=engine_main, args=(spec, theirs), name=f"pd-{role}", daemon=True)
        proc.start()
        theirs.close()
        self.procs.append(proc)
        self.proc_of[role] = proc
        self.conns.append(ours)
        self.names.append(role)

    def _admit(self, specs: list[EngineSpec], remote: str, threads: int, timeout_s: float) -> None:
        """Across machines: lesson 17's rendezvous and control sockets (remote.py)."""
        self.worker_set = ws = PDWorkerSet(self.launch, remote)
        self.procs = ws.procs                       # filled as it spawns: close() stops them on failure
        self.conns = ws.conns
        got = admit_engines(ws, specs, self.launch, remote, threads, timeout_s)
        self.names, self.conns, self.proc_of, self.info, self.offset_s = (got.names, got.conns, got.proc_of,
                                                                           got.info, got.offset_s)

    def _ready(self, i: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conns[i].poll(0.1):
                try:
                    kind, info = self._recv(i)
                except (EOFError, OSError):
                    raise EngineFailed(f"{self._died(i)} while starting") from None
                if kind == "error":
                    raise EngineFailed(f"the {self.names[i]} engine failed while starting:\n{info}")
                return info
            proc = self.proc_of[self.names[i]]
            if not proc.is_alive():
                raise EngineFailed(f"the {self.names[i]} engine exited with code {proc.exitcode} while starting")
        raise EngineFailed(f"the {self.names[i]} engine did not start within {timeout_s:g} s")

    def _recv(self, i: int):
        return pickle.loads(self.conns[i].recv_bytes())

    def _send(self, role: str, msg: tuple) -> None:
        i = self.names.index(role)
        try:
            self.conns[i].send(msg)
        except (OSError, ValueError):             # its process (or its machine) is gone
            self._gone(i)

    def _gone(self, i: int) -> None:
        """An engine's connection broke. PDCluster decides what that costs (a prefill engine can
        be done without)."""
        raise EngineFailed(self._died(i))

    def engines(self, role: str) -> list[str]:
        """The live engines of a role ("prefill", "decode", "colocated"), by name."""
        return [n for n in self.names if n.split("-")[0] == role]

    def _died(self, i: int) -> str:
        if self.names[i] not in self.proc_of:
            return (f"the {self.names[i]} engine on node 1 closed its connection (its process or its machine "
                    f"is gone)")
        proc = self.proc_of[self.names[i]]
        proc.join(1.0)
        code = proc.exitcode
        how = "is still running but closed its pipe" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        return f"the {self.names[i]} engine (pid {proc.pid}) {how}"

    # ---- questions to every engine ------------------------------------------------------------
    def ask(self, what: str, timeout_s: float = 30.0) -> dict[str, object]:
        """Each live engine's answer to ("stats",) or ("timeline",), by role."""
        self.replies: list[tuple] = []
        out = {}
        for role in list(self.names):
            self._send(role, (what,))
            deadline = time.monotonic() + timeout_s
            while role in self.names and not any(m[0] == what for m in self.replies):
                if time.monotonic() > deadline:
                    raise EngineFailed(f"the {role} engine did not answer {what!r} within {timeout_s:g} s")
                i = self.names.index(role)
                if self.conns[i].poll(0.05):
                    self._drain(i)
            if role not in self.names:                # a prefill engine lost meanwhile: no answer
                continue
            out[role] = next(m[1] for m in self.replies if m[0] == what)
            self.replies = []
        return out

    def stats(self) -> dict[str, dict]:
        return self.ask("stats")

    def timelines(self) -> list[Timeline]:
        out = []
        for role, d in self.ask("timeline").items():
            out.append(Timeline.from_dict(d))
            out[-1].offset_ns = round(self.offset_s.get(role, 0.0) * 1e9)
        return out


