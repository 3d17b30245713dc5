"""Hook an engine from the outside: after each step, if a page is open, publish a snapshot.

    engine.step  --replaced on the instance by-->  step():
                                                     no viewer?  -> the original step, nothing else
                                                     viewers     -> capture the batch the scheduler
                                                                    hands out, time the step, then
                                                                    snapshot -> hub.publish

No engine file changes: the wrapper is an attribute of the engine object (AsyncEngine, LLM.generate
and every run.py call `engine.step()` and find it), and detach() puts the original back.
`watch_class(LLMEngine)` does the same to every engine built while it is on, so a run.py that
builds several engines needs one line. The page shows the engine that stepped last.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Callable

from minivllm_support.watch.hub import Hub
from minivllm_support.watch.snapshot import Scheduled, StepInfo, build_snapshot, live_sequences, request_row


class Watcher:
    def __init__(self, hub: Hub | None = None, keep_finished: int = 32):
        self.hub = hub or Hub()
        self.t0 = time.perf_counter()
        self.engines: list[weakref.ref] = []       # every engine hooked, to unhook them on close
        self.current: weakref.ref | None = None    # the engine that stepped last
        self.finished_rows: deque[dict] = deque(maxlen=keep_finished)
        self.finished_total = 0
        self.hits: dict[int, int] = {}             # prefix-cache hash -> admissions that reused it
        self.parents: dict[int, int | None] = {}   # hash -> the hash before it in its chain
        self.errors = 0                            # snapshots that raised (the engine went on)
        self.last_error: str | None = None
        self._live: dict[int, object] = {}         # seq id -> Sequence, as of the last snapshot
        self._lock = threading.Lock()              # one snapshot at a time (engine thread vs idle refresh)
        self._last_publish = 0.0
        self._class_patches: list[tuple[type, Callable]] = []

    # ---- hooking ---------------------------------------------------------------------------
    def attach(self, engine) -> None:
        """Hook `engine.step` (and count prefix-cache hits per block, if it has lesson 13's cache)."""
        if "_watch_original_step" in engine.__dict__:
            return
        engine._watch_original_step = engine.__dict__.get("step")     # None: the class's method
        ref = weakref.ref(engine)
        original = engine.step                                          # bound: instance or class

        def step():
            if not self.hub._viewers:                                   # no page open: that is all
                return original()
            return self._watched_step(ref, original)
        engine.step = step
        self._hook_prefix_hits(engine)
        self.engines.append(ref)
        self.current = ref

    def detach(self, engine) -> None:
        if "_watch_original_step" not in engine.__dict__:
            return
        original = engine.__dict__.pop("_watch_original_step")
        if original is None:
            engine.__dict__.pop("step", None)
        else:
            engine.step = original
        bm = getattr(getattr(engine, "scheduler", None), "block_manager", None)
        if bm is not None and "_watch_original_match" in bm.__dict__:
            original = bm.__dict__.pop("_watch_original_match")
            if original is None:
                bm.__dict__.pop("match_prefix", None)
            else:
                bm.match_prefix = original

    def watch_class(self, cls: type) -> None:
        """Attach every instance of `cls` (and its subclasses) built from now on, until close()."""
        original = cls.__dict__["__init__"]
        watcher = self

        def __init__(engine, *args, **kwargs):
            original(engine, *args, **kwargs)
            watcher.attach(engine)
        cls.__init__ = __init__
        self._class_patches.append((cls, original))

    def close(self) -> None:
        for cls, original in self._class_patches:
            cls.__init__ = original
        self._class_patches.clear()
        for ref in self.engines:
            if (engine := ref()) is not None:
                self.detach(engine)
        self.engines.clear()
        self.hub.close()

    def _hook_prefix_hits(self, engine) -> None:
        """Lesson 13's block manager counts hit tokens, not hits per block; count those here, at
        admission (once per request, not per step), from the chain match_prefix leaves behind."""
        bm = getattr(getattr(engine, "scheduler", None), "block_manager", None)
        if bm is None or not hasattr(bm, "seq_hashes") or not hasattr(bm, "match_prefix"):
            return
        bm._watch_original_match = bm.__dict__.get("match_prefix")
        original = bm.match_prefix

        def match_prefix(seq):
            hit = original(seq)
            prev = None
            for h in bm.seq_hashes.get(seq.seq_id, ()):
                self.hits[h] = self.hits.get(h, 0) + 1
                self.parents[h] = prev
                prev = h
            if len(self.hits) > 2 * len(bm.blocks):      # forget hashes the cache evicted
                for h in [h for h in self.hits if h not in bm.cached]:
                    del self.hits[h]
            return hit
        bm.match_prefix = match_prefix

    # ---- publishing ------------------------------------------------------------------------
    def _watched_step(self, ref: weakref.ref, original: Callable):
        engine = ref()
        sched = engine.scheduler
        info = StepInfo()
        had = sched.__dict__.get("schedule")
        plain_schedule = sched.schedule

        def schedule():                     # record what each sequence gets, before it runs
            batch = plain_schedule()
            for seq, n in zip(batch.seqs, batch.num_tokens):
                total = len(seq.token_ids)
                info.scheduled[seq.seq_id] = Scheduled(n, seq.num_computed_tokens, total,
                                                       total - len(seq.prompt_token_ids))
                info.seqs.append(seq)
            return batch
        sched.schedule = schedule
        start = time.perf_counter()
        try:
            result = original()
        finally:
            if had is None:
                sched.__dict__.pop("schedule", None)
            else:
                sched.schedule = had
        info.seconds = time.perf_counter() - start
        if self.current is not ref:
            self._switch(ref)
        self.publish("step", info)
        return result

    def _switch(self, ref: weakref.ref) -> None:
        self.current = ref
        self._live.clear()

    def publish(self, kind: str, info: StepInfo | None) -> None:
        """Build a snapshot of the current engine and hand it to the hub; a failure here is
        counted and never reaches the engine."""
        engine = self.current() if self.current is not None else None
        if engine is None:
            return
        with self._lock:
            try:
                event = self._snapshot(engine, kind, info)
            except Exception as e:  # noqa: BLE001 - the page must never break the engine
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                return
            self._last_publish = time.perf_counter()
            self.hub.publish(event)

    def _snapshot(self, engine, kind: str, info: StepInfo | None) -> dict:
        running, waiting = live_sequences(engine)
        now_live = {s.seq_id: s for s in running + waiting}
        gone = {s.seq_id: s for s in list(self._live.values()) + (info.seqs if info else [])
                if s.seq_id not in now_live}
        scheduled = info.scheduled if info else {}
        for seq in gone.values():
            self.finished_rows.appendleft(request_row(seq, "finished", scheduled.get(seq.seq_id)))
            self.finished_total += 1
        self._live = now_live
        return build_snapshot(engine, kind, time.perf_counter() - self.t0, info, list(self.finished_rows),
                              self.finished_total, self.hits, self.parents)

    def refresh_if_idle(self, min_age_s: float = 1.0) -> None:
        """Called by a viewer that waited `min_age_s` for an event: an idle engine publishes
        nothing, yet its state can change between steps (an aborted request frees its blocks),
        so an idle engine is pictured from the viewer's thread. A busy one is left alone (it is
        mid-step; its next step publishes)."""
        engine = self.current() if self.current is not None else None
        if engine is None or time.perf_counter() - self._last_publish < min_age_s:
            return
        has_work = getattr(engine, "has_unfinished", None)
        if has_work is not None and not has_work():
            self.publish("idle", None)

    def on_subscribe(self, viewer) -> None:
        """A page just opened: send it the state at once."""
        if self.hub.last is not None:
            viewer.deliver(self.hub.last)
        self.refresh_if_idle(min_age_s=0.0)
