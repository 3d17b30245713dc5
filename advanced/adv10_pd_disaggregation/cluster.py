"""The launcher: starts the engine processes, plays a request stream into them, times every token.

    disaggregated                                   colocated
    request --> prefill process (max_tokens=1)      request --> one engine process
            \\-> decode process (allocates, waits                 (prefills and decodes mixed)
                 for the layers, then decodes)
    prefill -> launcher: "started" / "prefilled" --> forwarded to decode (arms its transfer timeout;
                                                     says every layer of the request is sent)

It is the proxy in front of the two engines. It sends each request to both at once, so the
decode engine allocates its blocks first and loads layer 0 while the prefill engine is still on
the later layers (vLLM's example proxy waits for the prefill to finish before it asks decode).
A transfer the decode engine asks for again (a retry) goes back to the prefill engine that had
it. Faults: a prefill process that dies turns every transfer still open into a counted local
recompute on the decode side, and later requests run there alone; a decode process that dies is
an error naming its exit code, the others are stopped, and nothing is left running. The
processes themselves (pipes, or control sockets across machines) are launcher.py's.
"""
from __future__ import annotations

import shutil
import sys
import time
from multiprocessing.connection import wait

import torch

from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.launch import NodeLaunch
from step17_tensor_parallel.workers import shutdown
from advanced.adv10_pd_disaggregation.launcher import EngineFailed, EngineHandles, free_port
from advanced.adv10_pd_disaggregation.process import EngineSpec, parse_fault
from advanced.adv10_pd_disaggregation.records import PDRecord, PDRequest
from advanced.adv10_pd_disaggregation.remote import check_launch
from advanced.adv10_pd_disaggregation.store import default_root

__all__ = ["EngineFailed", "PDCluster", "PDRequest", "free_port"]


class PDCluster(EngineHandles):
    def __init__(self, folder: str, mode: str = "disaggregated", dtype: torch.dtype = torch.float32,
                 config: PagedSchedulerConfig | None = None, threads: int = 1, transfer_timeout_s: float = 10.0,
                 fault: str = "", start_timeout_s: float = 120.0, transport: str = "store",
                 num_prefill: int = 1, num_decode: int = 1, launch: NodeLaunch | None = None,
                 remote: str = "decode"):
        """num_prefill x num_decode engines (N:M, the store transport only: gloo here joins exactly
        two processes); threads: torch threads of each engine process. launch: lesson 17's flags
        for two machines (gloo only): the `remote` engine ("decode" or "prefill") is the one node 1
        runs (node.py), the other runs here (remote.py)."""
        if mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
        if threads < 1 or transfer_timeout_s <= 0:
            raise ValueError(f"need threads >= 1 and transfer_timeout_s > 0, got {threads}, {transfer_timeout_s}")
        if transport not in ("store", "gloo"):
            raise ValueError(f"transport must be 'store' or 'gloo', got {transport!r}")
        if num_prefill < 1 or num_decode < 1 or (transport == "gloo" and (num_prefill, num_decode) != (1, 1)):
            raise ValueError(f"{num_prefill} prefill x {num_decode} decode engines: need at least one of each, "
                             f"and exactly one of each with the gloo transport")
        parse_fault(fault)                              # a bad fault string fails here, not in a child
        self.launch = launch if launch is not None and launch.multi_node else None
        if self.launch is not None:
            check_launch(self.launch, mode, transport, remote)
        self._init_handles()
        self.mode, self.config = mode, config or PagedSchedulerConfig()
        self.root = default_root() if mode == "disaggregated" and transport == "store" else None
        port = free_port() if mode == "disaggregated" and transport == "gloo" else 0
        self.prefill_lost: str | None = None
        self.records: dict[int, PDRecord] = {}
        self.prompts: dict[int, list[int]] = {}         # kept for a retry
        roles = ([("prefill", i, num_prefill) for i in range(num_prefill)] + [("decode", i, num_decode)
                 for i in range(num_decode)] if mode == "disaggregated" else [("colocated", 0, 1)])
        specs = [EngineSpec(role, str(folder), dtype, threads, self.config, str(self.root or ""), transfer_timeout_s,
                            fault, rank, transport, port, start_timeout_s) for rank, (role, _, _) in enumerate(roles, 1)]
        try:
            if self.launch is not None:
                self._admit(specs, remote, threads, start_timeout_s)
                return
            for spec, (role, i, n) in zip(specs, roles):
                self._spawn(role if n == 1 else f"{role}-{i}", spec)   # "prefill", or "prefill-0", ...
            self.info = [self._ready(i, start_timeout_s) for i in range(len(roles))]
        except BaseException:
            self.close()
            raise

    def least_loaded(self, role: str) -> str:
        """The engine of `role` with the fewest requests still in its hands (N:M routing)."""
        def load(name: str) -> int:
            if role == "prefill":
                return sum(r.prefill_on == name and r.prefill_finished < r.prefill_sent and not r.done
                           for r in self.records.values())
            return sum(r.decode_on == name and not r.done for r in self.records.values())
        return min(self.engines(role), key=load)

    # ---- a run ---------------------------------------------------------------------------------
    def run(self, requests: list[PDRequest], timeout_s: float = 300.0) -> list[PDRecord]:
        """Send each request at its arrival time; return when every one has finished."""
        base = len(self.records)
        todo = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        t0, deadline = time.perf_counter(), time.monotonic() + timeout_s
        recs = [PDRecord(base + i, len(r.prompt_ids)) for i, r in enumerate(requests)]
        self.records.update({r.rid: r for r in recs})
        while not all(r.done for r in recs):
            if time.monotonic() > deadline:
                raise EngineFailed(f"{sum(not r.done for r in recs)} requests unfinished after {timeout_s:g} s")
            now = time.perf_counter() - t0
            while todo and requests[todo[0]].arrival_s <= now:
                i = todo.pop(0)
                self._submit(recs[i], requests[i])
            gap = requests[todo[0]].arrival_s - now if todo else 0.05
            for conn in wait(self.conns, timeout=max(0.0, min(gap, 0.05))):
                self._drain(self.conns.index(conn))
        return recs

    def _submit(self, rec: PDRecord, req: PDRequest) -> None:
        rec.start = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        remote = self.mode == "disaggregated" and bool(self.engines("prefill"))
        rec.decode_on = self.least_loaded("decode" if self.mode == "disaggregated" else "colocated")
        if remote:
            rec.prefill_on = self.least_loaded("prefill")
            self.prompts[rec.rid] = req.prompt_ids
            self._to_prefill(rec)
            remote = rec.prefill_on in self.names     # it may have been found gone just now
        if self.mode == "disaggregated" and not remote:
            rec.fallback = f"no prefill engine ({self.prefill_lost})"
        self._send(rec.decode_on, ("add", rec.rid, req.prompt_ids, params, remote))

    def _to_prefill(self, rec: PDRecord) -> None:
        rec.prefill_sent += 1
        self._send(rec.prefill_on, ("add", rec.rid, self.prompts[rec.rid]))

    def _retry(self, rid: int, reason: str, layer: int) -> None:
        """The decode engine asks for a transfer again: the prefill engine runs the request once
        more (a copy from its prefix cache if its blocks are still there); if it is gone, the
        decode engine falls back."""
        rec = self.records[rid]
        rec.retry = reason
        print(f"[minivllm] request {rid}: KV transfer failed ({reason}); asked again from layer {layer}",
              file=sys.stderr)
        if rec.prefill_on in self.names:
            self._to_prefill(rec)
        else:
            self._send(rec.decode_on, ("lost", rid, self.prefill_lost or "the prefill engine is gone"))

    def _drain(self, i: int) -> None:
        role = self.names[i]
        try:
            while self.conns[i].poll(0):
                self._handle(role, self._recv(i))
        except (EOFError, OSError):
            self._gone(i)

    def _gone(self, i: int) -> None:
        role = self.names[i]
        if not role.startswith("prefill"):
            raise EngineFailed(f"{self._died(i)}; {sum(not r.done for r in self.records.values())} "
                               f"requests unfinished") from None
        self._lose_prefill(role, self._died(i))

    def _lose_prefill(self, name: str, why: str) -> None:
        """A prefill engine is gone: its open transfers become fallbacks on their decode engines;
        later requests go to the other prefill engines, or to a decode engine alone."""
        i = self.names.index(name)
        self.conns.pop(i).close()
        self.names.pop(i)
        self.prefill_lost = why
        print(f"[minivllm] {why}: its open transfers fall back to local prefill on the decode engines",
              file=sys.stderr)
        for rec in self.records.values():
            if rec.prefill_on == name and rec.prefill_finished < rec.prefill_sent and not rec.done \
                    and rec.fallback is None:
                self._send(rec.decode_on, ("lost", rec.rid, why))

    def _handle(self, role: str, msg: tuple) -> None:
        kind = msg[0]
        if kind == "error":
            raise EngineFailed(f"the {role} engine raised:\n{msg[1]}")
        if kind == "started":                     # forwarded for the latest attempt only
            for rid in msg[1]:
                rec = self.records[rid]
                rec.prefill_started += 1
                if rec.prefill_started == rec.prefill_sent:
                    self._send(rec.decode_on, ("started", rid))
        elif kind == "prefilled":
            rec = self.records[msg[1]]
            rec.prefill_finished += 1
            if rec.prefill_finished == rec.prefill_sent:
                rec.prefill_done = msg[3] + self.offset_s.get(role, 0.0)
                self._send(rec.decode_on, ("prefilled", msg[1]))
        elif kind == "retry":
            self._retry(*msg[1:])
        elif kind == "tokens":
            off = self.offset_s.get(role, 0.0)
            for rid, token, t, finished, facts in msg[1]:
                rec = self.records[rid]
                rec.token_ids.append(token)
                rec.token_times.append(t + off)
                if facts:
                    facts.update({k: facts[k] + off for k in ("opened", "first_layer", "landed")})
                rec.transfer = rec.transfer or facts
                rec.done = finished
        elif kind == "fallback":
            _, rid, reason, tokens = msg
            self.records[rid].fallback = reason
            print(f"[minivllm] request {rid}: KV transfer failed ({reason}); its {tokens} prompt tokens are "
                  f"recomputed on the decode engine", file=sys.stderr)
        else:
            self.replies.append(msg)

    def close(self) -> None:
        """Stop every engine process (ask, then terminate, then kill) and remove the store."""
        shutdown(self.procs, self.conns, wait_s=5.0)
        self.exit_codes = {role: p.exitcode for role, p in self.proc_of.items()}   # 0: a clean stop
        self.procs, self.conns, self.worker_set = [], [], None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PDCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
