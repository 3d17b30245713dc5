"""One replica: a whole engine in its own process, its own KV pool and prefix cache.

    replica (rank index+1) dials the store at master-addr:port, then the front end's control
    socket (lesson 17's control.py: token, rank, flags checked); from then on, one connection:
    replica --conn--> front end: ("ready", facts) once (or ("error", traceback)), then it answers
                                 the front end's ("clock", t) pings (timeline.answer_offset)
    front end --conn--> replica: ("trace", on) once, then ("add", rid, prompt_ids, params) |
                                 ("abort", rid) | ("stack",) | ("timeline",) | b"" (stop)
    replica --conn--> front end: ("event", rid, TokenEvent, logprobs entry, EngineStats) per token,
                                 ("error", rid, kind, message, EngineStats) when a request fails,
                                 ("stack", text) when asked where its engine thread is,
                                 ("timeline", spans) when asked, with trace on (its engine steps),
                                 ("dead", account) just before it exits

Inside, it is lesson 20's serving stack without HTTP: the engine of lesson 19 (lesson 16's fast-path at
tensor_parallel_size 1, with logprobs) under lesson 20's LogprobFrontEnd, the engine loop in
the main thread (`drive`, lesson 18: oneDNN is fastest there) and an asyncio loop beside it
that turns control-connection messages into `stream()` calls. So lesson 18's fault rules hold
unchanged: a failed step ends its own requests (StepFailed), repeated faults make the engine
dead (EngineDead); the replica then tells the front end why and exits with lesson 20's exit code.

Every message carries the engine's stats: the front end's view of each replica's load is as
fresh as the last token it produced. The connection is a TCP socket wrapped as a
multiprocessing Connection, so the same code runs whether the front end is on this machine or
another (node.py starts the replicas of a machine without a front end; under torchrun each
rank but 0 turns into its replica in place, node.run_torchrun_replica).
"""
from __future__ import annotations

import asyncio
import os
import pickle
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from advanced.adv08_data_parallel.faults import FAULT_ENV, arm_fault, parse_fault
from step18_benchmark.faults import EngineDead, FaultPolicy
from minivllm_support.timeline import Timeline, answer_offset
from step17_tensor_parallel.lifeline import die_with_parent
from step17_tensor_parallel import control, parallel
from step17_tensor_parallel.control import RendezvousError
from step19_real_model.engine import build_engine
from step20_http_serve.async_llm import LogprobFrontEnd
from step20_http_serve.server import EXIT_ENGINE_DEAD

STOP_GRACE_S = 10.0              # told to stop (or the front end vanished): gone by then, whatever


@dataclass
class ReplicaSpec:
    index: int
    num_replicas: int
    folder: str
    dtype: torch.dtype
    threads: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    enforce_eager: bool
    master_addr: str = "127.0.0.1"   # where the front end's store listens (node 0)
    port: int = 0
    nnodes: int = 1
    rendezvous_timeout_s: float = 60.0

    # Rank 0 is the front end (it holds no engine, as vLLM's API server holds none); replica i is
    # rank i+1, so lesson 17's rule "everyone but rank 0 dials rank 0" holds unchanged.
    @property
    def rank(self) -> int:
        return self.index + 1

    @property
    def world(self) -> int:
        return self.num_replicas + 1

    def flags(self) -> control.RunFlags:
        """What the front end compares at the rendezvous: model, dtype, and (through world) N."""
        return control.RunFlags(control.model_fingerprint(self.folder), str(self.dtype), self.world, self.nnodes,
                                extra="data-parallel")


def trace_steps(engine, tl: Timeline) -> None:
    """Each engine.step() becomes a "compute" span (while tl.enabled: the front end's ("trace", on)
    turns it on); the gaps between them are the replica idle."""
    step = engine.step

    def traced() -> list:
        with tl.span("step", "compute") as args:
            sampled = step()
            args["tokens"] = len(sampled)
        return sampled
    engine.step = traced            # AsyncEngine calls engine.step(): the instance attribute wins


def dial_front_end(spec: ReplicaSpec) -> Connection:
    """Lesson 17's worker side: the store, then the front end's control socket."""
    store = parallel.make_store(spec.rank, spec.world, spec.port, spec.rendezvous_timeout_s, spec.master_addr,
                                is_master=False)
    who = f"replica {spec.index} on {socket.gethostname()} pid {os.getpid()}"
    return control.connect_to_rank0(store, spec.master_addr, spec.rank, spec.flags(), who, spec.rendezvous_timeout_s)


def replica_main(spec: ReplicaSpec) -> None:
    """Entry point of a replica process (spawned by the front end on node 0, or by node.py). It
    never outlives the process that started it (lesson 17's lifeline.py)."""
    die_with_parent()
    try:
        conn = dial_front_end(spec)
    except (RendezvousError, OSError) as e:     # no front end, or it refused our flags: say so, exit 2
        print(f"[minivllm] replica {spec.index}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    ready = False
    try:
        torch.set_num_threads(spec.threads)
        torch.set_grad_enabled(False)
        fault = parse_fault(os.environ.get(FAULT_ENV, ""), spec.index, spec.num_replicas)
        engine = build_engine(spec.folder, spec.dtype, max_num_seqs=spec.max_num_seqs,
                              max_num_batched_tokens=spec.max_num_batched_tokens, kv_cache_bytes=spec.kv_cache_bytes,
                              enforce_eager=spec.enforce_eager, threads_per_rank=spec.threads)
        arm_fault(engine, fault)
        tl = Timeline(spec.index, f"replica {spec.index}", enabled=False)
        trace_steps(engine, tl)
        front = LogprobFrontEnd(engine, threaded=False, policy=FaultPolicy())
        bm = engine.scheduler.block_manager
        conn.send(("ready", {"pid": os.getpid(), "host": socket.gethostname(), "num_blocks": bm.num_blocks,
                             "block_size": bm.block_size, "threads": torch.get_num_threads()}))
        ready = True
        answer_offset(conn)                     # the front end reads our clock against its own
        dead = front.drive(lambda: asyncio.run(_serve(front, engine, conn, tl)))
        if dead is not None:
            conn.send(("dead", f"replica {spec.index} (pid {os.getpid()}): {dead}"))
            raise SystemExit(EXIT_ENGINE_DEAD)
    except (EOFError, KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        pass                                    # the front end is gone or Ctrl-C: just leave
    except SystemExit:
        raise
    except BaseException:
        try:   # while starting, lesson 17's WorkerSet convention; afterwards, the front end's hub's
            conn.send(("dead" if ready else "error", f"replica {spec.index} (pid {os.getpid()}):\n"
                       f"{traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
        raise SystemExit(1)


async def _serve(front: LogprobFrontEnd, engine, conn: Connection, tl: Timeline) -> EngineDead | None:
    """The asyncio side: control-connection messages in, token events out. Returns the EngineDead that ended
    the engine, or None after a stop."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    tasks: dict[int, asyncio.Task] = {}
    main_id = threading.main_thread().ident
    dead: list[EngineDead] = []
    # Called in the engine (main) thread when the engine is declared dead: wake this loop.
    front.on_dead = lambda e: loop.call_soon_threadsafe(inbox.put_nowait, ("dead", e))

    def send(msg: tuple) -> None:
        try:
            conn.send(msg)
        except (OSError, ValueError):
            inbox.put_nowait(None)              # the front end is gone: stop

    def read() -> None:                         # a daemon thread: a blocked read never holds up exit
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                data = b""
            msg = pickle.loads(data) if data else None
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, msg)
            except RuntimeError:                # the loop has ended
                return
            if msg is None:   # stopped, or the front end is gone: an engine stuck in a step must
                # not keep this process (on a machine nobody watches) alive; a normal exit beats this
                timer = threading.Timer(STOP_GRACE_S, os._exit, args=(1,))
                timer.daemon = True
                timer.start()
                return

    async def run(rid: int, prompt_ids: list[int], params) -> None:
        try:
            async for event, entry in front.stream(prompt_ids, params):
                send(("event", rid, event, entry, engine.stats()))
        except asyncio.CancelledError:
            pass                                # aborted by the front end: stream() aborted it here
        except Exception as e:  # noqa: BLE001 - the request's own error, sent to its caller
            send(("error", rid, type(e).__name__, str(e), engine.stats()))
        finally:
            tasks.pop(rid, None)

    threading.Thread(target=read, name="replica-conn", daemon=True).start()
    while True:
        msg = await inbox.get()
        if msg is None:
            break
        kind = msg[0]
        if kind == "add":
            _, rid, prompt_ids, params = msg
            tasks[rid] = asyncio.create_task(run(rid, prompt_ids, params))
        elif kind == "abort" and msg[1] in tasks:
            tasks[msg[1]].cancel()
        elif kind == "stack":
            frame = sys._current_frames().get(main_id)
            send(("stack", "".join(traceback.format_stack(frame)) if frame else "(no main thread)"))
        elif kind == "timeline":
            send(("timeline", tl.to_dict()))
            tl.clear()
        elif kind == "trace":
            tl.enabled = msg[1]
        elif kind == "dead":
            dead.append(msg[1])
            break
    if dead and tasks:        # their streams end with the step's error or EngineDead: let them say so
        await asyncio.wait(list(tasks.values()), timeout=1.0)
    for task in list(tasks.values()):
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)   # their errors went out already
    return dead[0] if dead else None
