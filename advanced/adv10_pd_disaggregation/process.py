"""An engine process: the prefill engine, the decode engine, or the colocated one, behind a pipe
(or, across machines, lesson 17's control socket: remote.py).

    launcher --pipe--> engine: ("add", rid, prompt_ids, params, remote) | ("started", rid) |
                               ("prefilled", rid) | ("lost", rid, reason) | ("stats",) |
                               ("timeline",) | b"" (stop)
    engine --pipe--> launcher: ("ready", facts) once, or ("error", traceback) before it exits;
        prefill: ("started", [rid], t) when a prompt's last step begins (its layers start to ship),
                 ("prefilled", rid, token, t) after that step (every layer it will send is out;
                 t: when the last one was handed to the transport)
        decode / colocated: ("tokens", [(rid, token, t, finished, transfer facts)]) after each step,
                 ("retry", rid, reason, first layer missing) when a transfer failed the first time
                 (the launcher has the prefill engine run the request again),
                 ("fallback", rid, reason, tokens recomputed) when a transfer is given up

Each process is an ordinary engine loop: take messages, run a step if there is work, else wait
(the decode engine waits on the next layer of a load in flight). It ends with its launcher
(lesson 17's worker_exit: die_with_parent, a traceback to the launcher on a crash).
"""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from minivllm_support.timeline import Timeline, answer_offset
from step04_transformer.loader import load_model
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.worker import worker_exit
from step17_tensor_parallel import parallel
from advanced.adv10_pd_disaggregation.connector import ConnectorWorker, prompt_key
from advanced.adv10_pd_disaggregation.engines import DecodeEngine, PrefillEngine, build_pd_engine
from advanced.adv10_pd_disaggregation.gloo import DECODE_RANK, PREFILL_RANK, GlooConnectorWorker
from advanced.adv10_pd_disaggregation.store import KVStore, StoreConnectorWorker

FAULT_KINDS = ("drop", "drop-once", "exit-prefill", "exit-decode")
IDLE_WAIT_S = 0.05          # an idle engine checks its pipe this often
STOP_WAIT_S = 3.0           # on close, how long the decode engine waits for the prefill's STOP
LOAD_WAIT_S = 0.002         # a decode engine with only loads in flight looks at the store this often


def parse_fault(fault: str) -> dict[str, int]:
    """Injected faults, comma-separated: "drop:R" (request R's last layer is never sent: the
    retry fails too), "drop-once:R" (it is lost the first time only: the retry brings it),
    "exit-prefill:R" (the prefill process dies after shipping request R's layer 0),
    "exit-decode:R" (the decode process dies when request R gets its first token)."""
    faults = {}
    for part in filter(None, fault.split(",")):
        kind, _, rid = part.partition(":")
        if kind not in FAULT_KINDS or not rid.isdigit() or kind in faults:
            raise ValueError(f"fault {fault!r}: expected a comma-separated list of distinct "
                             f"{', '.join(k + ':<request>' for k in FAULT_KINDS)}")
        faults[kind] = int(rid)
    return faults


@dataclass
class EngineSpec:
    role: str                     # "prefill" | "decode" | "colocated"
    folder: str
    dtype: torch.dtype
    threads: int
    config: PagedSchedulerConfig
    store_root: str = ""
    transfer_timeout_s: float = 10.0
    fault: str = ""
    rank: int = 1                 # its row on the timeline
    transport: str = "store"      # "store" (store.py) | "gloo" (gloo.py)
    port: int = 0                 # gloo: where the prefill process hosts the rendezvous
    join_timeout_s: float = 120.0
    align_clock: bool = False     # answer the launcher's clock pings after "ready" (another machine's clock)


def engine_main(spec: EngineSpec, conn: Connection) -> None:
    """An engine process on the launcher's machine, behind a pipe."""
    with worker_exit(f"{spec.role} engine") as state:
        state.conn = conn
        serve(spec, conn)


def serve(spec: EngineSpec, conn: Connection, rendezvous=None) -> None:
    """Load, join the other engine (gloo), build the engine, say ready, run its loop until told to
    stop. conn: a pipe, or lesson 17's control socket (node.py); rendezvous: the launcher's store
    when the engines meet there (across machines), else the prefill process hosts one."""
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    fault = parse_fault(spec.fault)
    tl = Timeline(spec.rank, f"{spec.role} engine (pid {os.getpid()})")
    model = load_model(spec.folder, spec.dtype)
    if spec.role != "colocated" and spec.transport == "gloo":     # prefill rank 0, decode rank 1
        rank = PREFILL_RANK if spec.role == "prefill" else DECODE_RANK
        rendezvous = rendezvous or parallel.make_store(rank, 2, spec.port, spec.join_timeout_s)
        parallel.init_group(rendezvous, rank, 2, spec.join_timeout_s)
    store = KVStore(spec.store_root) if spec.transport == "store" and spec.role != "colocated" else None

    def make_worker(pool, num_layers: int) -> ConnectorWorker:
        drop = {(fault["drop"], num_layers - 1)} if "drop" in fault else set()
        once = {(fault["drop-once"], num_layers - 1)} if "drop-once" in fault else set()
        if store is None:
            return GlooConnectorWorker(pool, num_layers, spec.transfer_timeout_s, drop, tl, spec.role, once)
        return StoreConnectorWorker(store, pool, num_layers, spec.transfer_timeout_s, drop, tl, once)

    send = conn.send
    on_start = (lambda rids: send(("started", rids, time.perf_counter()))) if spec.role == "prefill" else None
    extra = {"make_worker": make_worker} if spec.role != "colocated" else {}
    if on_start:
        extra["on_save_start"] = on_start
    if spec.role == "decode":                   # the launcher has the prefill engine send it again
        extra["on_retry"] = lambda r: send(("retry", r.req_id, r.reason, r.from_layer))
    engine = build_pd_engine(model, spec.role, config=spec.config, **extra)
    if "exit-prefill" in fault and isinstance(engine, PrefillEngine):
        arm_exit_after_layer0(engine, fault["exit-prefill"])
    bm = engine.scheduler.block_manager
    conn.send(("ready", {"pid": os.getpid(), "num_blocks": bm.num_blocks, "block_size": bm.block_size}))
    if spec.align_clock:
        answer_offset(conn)                      # the launcher maps this process's times onto its clock
    loop = prefill_loop if isinstance(engine, PrefillEngine) else decode_loop
    loop(engine, conn, tl, fault)


def arm_exit_after_layer0(engine: PrefillEngine, rid: int) -> None:
    """The injected crash: the process vanishes mid-transfer, after request rid's layer 0."""
    save = engine.worker.save_kv_layer

    def save_then_maybe_die(layer: int, pool) -> None:
        save(layer, pool)
        if layer == 0 and any(s.req_id == rid for s in engine.worker._saves):
            os._exit(3)
    engine.worker.save_kv_layer = save_then_maybe_die


def messages(conn: Connection, wait_s: float):
    """The messages waiting on the pipe (waiting up to wait_s for the first); None means stop."""
    if not conn.poll(wait_s):
        return
    while True:
        data = conn.recv_bytes()
        yield pickle.loads(data) if data else None
        if not conn.poll(0):
            return


def common(msg, engine, conn: Connection, tl: Timeline) -> bool:
    """The messages every role answers; True when handled."""
    if msg[0] == "stats":
        bm = engine.scheduler.block_manager
        conn.send(("stats", {"free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks,
                             "fallbacks": len(getattr(engine, "fallbacks", ())),
                             "retries": len(getattr(engine, "retries", ())),
                             "resends": getattr(engine, "resends", 0), "prompt_tokens": engine.prompt_tokens,
                             "bytes_saved": getattr(getattr(engine, "worker", None), "bytes_saved", 0),
                             "bytes_loaded": getattr(getattr(engine, "worker", None), "bytes_loaded", 0),
                             "unfinished": engine.has_unfinished()}))
        return True
    if msg[0] == "timeline":
        conn.send(("timeline", tl.to_dict()))
        tl.clear()
        return True
    return False


def prefill_loop(engine: PrefillEngine, conn: Connection, tl: Timeline, fault: dict[str, int]) -> None:
    rid_of: dict[int, int] = {}                 # seq id -> request id
    seen: set[int] = set()
    engine.resends = 0
    while True:
        for msg in messages(conn, 0 if engine.has_unfinished() else IDLE_WAIT_S):
            if msg is None:
                if isinstance(engine.worker, GlooConnectorWorker):
                    engine.worker.stop_receiver()       # the decode side's thread ends cleanly
                return
            if msg[0] == "add":                  # the same request again: a retry (its blocks may
                _, rid, prompt_ids = msg[:3]         # still be in the prefix cache: then it is a copy)
                engine.resends += rid in seen
                seen.add(rid)
                rid_of[engine.add_prefill(rid, prompt_ids, prompt_key(prompt_ids, rid)).seq_id] = rid
            elif not common(msg, engine, conn, tl):
                raise ValueError(f"prefill engine: unknown message {msg[0]!r}")
        if engine.has_unfinished():
            with tl.span("prefill step", "compute") as args:
                sampled = engine.step()
                args["requests"] = [rid_of[s.seq_id] for s in sampled]
            for seq in sampled:             # when its last layer was handed to the transport
                rid = rid_of.pop(seq.seq_id)
                conn.send(("prefilled", rid, seq.token_ids[-1], engine.worker.saved_at.pop(rid, time.perf_counter())))


def decode_loop(engine, conn: Connection, tl: Timeline, fault: dict[str, int]) -> None:
    """The decode engine's loop (the colocated engine runs it too: without loads)."""
    rid_of: dict[int, int] = {}
    is_decode = isinstance(engine, DecodeEngine)
    reported = 0
    while True:
        busy = engine.has_runnable() if is_decode else engine.has_unfinished()
        loading = is_decode and engine.has_transfers()
        t0 = time.perf_counter_ns()
        # Nothing to compute but loads in flight: the pipe is watched for LOAD_WAIT_S (no CPU
        # spent), then the store is looked at once; a spinning reader would slow the prefill
        # process on the same machine.
        for msg in messages(conn, 0 if busy else LOAD_WAIT_S if loading else IDLE_WAIT_S):
            if msg is None:
                stop_receiver_thread(engine)
                return
            kind = msg[0]
            if kind == "add":
                _, rid, prompt_ids, params, remote = msg
                seq = (engine.add_consumer(rid, prompt_ids, params, prompt_key(prompt_ids, rid)) if remote
                       else engine.add_request(prompt_ids, params))
                rid_of[seq.seq_id] = rid
            elif kind in ("started", "prefilled", "lost") and is_decode:
                if kind == "started":
                    engine.worker.arm(msg[1])
                elif kind == "prefilled":
                    engine.worker.producer_done(msg[1])
                else:
                    engine.fail_transfer(msg[1], msg[2])
            elif not common(msg, engine, conn, tl):
                raise ValueError(f"{'decode' if is_decode else 'colocated'} engine: unknown message {kind!r}")
        if busy:
            with tl.span("decode step" if is_decode else "step", "compute") as args:
                sampled = engine.step()
                args["tokens"] = len(sampled)
            out = []
            for seq in sampled:
                rid = rid_of[seq.seq_id]
                facts = transfer_facts(engine, rid) if len(seq.output_token_ids) == 1 else None
                out.append((rid, seq.token_ids[-1], seq.token_times[-1], seq.is_finished, facts))
                if fault.get("exit-decode") == rid:
                    os._exit(3)                    # the injected crash: gone without a word
            if out:
                conn.send(("tokens", out))
        elif loading:
            engine.advance_transfers()
            tl.add("wait for KV", "wait", t0, time.perf_counter_ns())
        if is_decode:
            for fb in engine.fallbacks[reported:]:
                conn.send(("fallback", fb.req_id, fb.reason, fb.tokens_recomputed))
            reported = len(engine.fallbacks)


def stop_receiver_thread(engine) -> None:
    """A gloo receiver thread still inside a receive when the interpreter shuts down aborts the
    process ("terminate called ..."). The prefill engine sends STOP as it closes; if the thread has
    not ended within STOP_WAIT_S (the prefill is gone), leave at once, skipping the teardown."""
    worker = getattr(engine, "worker", None)
    if isinstance(worker, GlooConnectorWorker) and not worker.receiver_stopped(STOP_WAIT_S):
        os._exit(0)


def transfer_facts(engine, rid: int) -> dict | None:
    """When a request's KV landed here, layer by layer, and how many bytes: for the TTFT split."""
    load = getattr(engine, "loads", {}).pop(rid, None)
    if load is None or len(load.landed) < engine.worker.num_layers:
        return None                                # no transfer, or it was given up
    return {"opened": load.opened, "first_layer": load.landed[0], "landed": load.landed[-1], "bytes": load.bytes}
