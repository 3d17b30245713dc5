"""Transport 2: torch.distributed point-to-point messages (gloo over TCP) from the prefill process
(rank 0) to the decode process (rank 1), layer by layer.

    prefill: save_kv_layer(l)  isend header [request, layer, blocks], then isend [2, blocks, ...]
                               (K and V of the request's blocks: a copy, so the blocks may be freed)
    decode:  a receiver thread  recv header -> recv that many blocks -> put (request, layer, tensor)
                               on a queue; it is always waiting for the next message
             wait_for_layer_load(l)  take what the queue holds; is layer l of this request there?
                               copy its blocks into the pool

Why a thread: gloo is receiver-driven (a send completes only once the matching receive is
posted), and a gloo receive cannot be polled (its `is_completed` stays false until someone
waits on it) nor waited on with a time-out and then waited on again. So one thread waits for
everything, in the order it was sent, and the engine only ever looks at a queue. A layer that
comes before its load is open is kept for it; one for a load already over is read and dropped,
so nothing stays posted and nothing leaks. What
this transport cannot tell by itself: that the prefill process died (the launcher tells the
decode engine, and the transfer timeout is the last resort, as with the store).
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from advanced.adv10_pd_disaggregation.connector import ConnectorMetadata, ConnectorWorker, OpenLoad, SaveSpec

PREFILL_RANK, DECODE_RANK = 0, 1
STOP = -1                     # a header with this request id ends the receiver thread


class GlooConnectorWorker(ConnectorWorker):
    lands_before_done = False         # a layer may still be on the wire when the prefill reports done

    def __init__(self, pool, num_layers: int, transfer_timeout_s: float = 10.0,
                 drop_layers: set[tuple[int, int]] | None = None, timeline=None, role: str = "decode",
                 drop_once: set[tuple[int, int]] | None = None):
        super().__init__(num_layers, transfer_timeout_s, drop_layers, drop_once)
        self.pool = pool
        self.landed: dict[tuple[int, int], torch.Tensor] = {}     # (request, layer) -> [2, blocks, ...]
        self.closed: set[int] = set()            # requests whose load is over: late layers are dropped
        self.inbox: queue.Queue = queue.Queue()
        self.sending: list[tuple[dist.Work, torch.Tensor]] = []
        self._saves: list[SaveSpec] = []
        self.bytes_saved = self.bytes_loaded = self.save_errors = 0
        self.saved_at: dict[int, float] = {}      # request -> when its latest layer was handed over
        self.timeline = timeline
        self.receiver_error: str | None = None
        self.receiver: threading.Thread | None = None
        if role == "decode":
            self.receiver = threading.Thread(target=self._receive, name="kv-receiver", daemon=True)
            self.receiver.start()

    # ---- decode side ---------------------------------------------------------------------------
    def _receive(self) -> None:
        block_shape, dtype = self.pool.k[0].shape[1:], self.pool.k[0].dtype
        header = torch.empty(3, dtype=torch.long)
        try:
            while True:
                dist.recv(header, PREFILL_RANK)
                req_id, layer, blocks = header.tolist()
                if req_id == STOP:
                    return
                buf = torch.empty(2, blocks, *block_shape, dtype=dtype)
                dist.recv(buf, PREFILL_RANK)
                self.inbox.put((req_id, layer, buf))
        except Exception as e:  # noqa: BLE001 - the prefill process is gone: nothing more will come
            self.receiver_error = f"{type(e).__name__}: {e}"

    def wait_for_layer_load(self, req_id: int, layer: int, timeout_s: float = 0.0) -> bool:
        deadline = time.perf_counter() + timeout_s
        while (req_id, layer) not in self.landed:
            try:
                r, l, buf = self.inbox.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                return False
            if r not in self.closed:              # may be a load not opened yet: kept for it
                self.landed[(r, l)] = buf
        t0 = time.perf_counter_ns()
        buf = self.landed.pop((req_id, layer))
        load = self.open[req_id]
        spec, n, first = load.spec, len(load.spec.block_ids), load.spec.first_block
        ids = torch.tensor(spec.block_ids)
        self.pool.k[layer].index_copy_(0, ids, buf[0, first:first + n])
        self.pool.v[layer].index_copy_(0, ids, buf[1, first:first + n])
        nbytes = 2 * n * buf[0, 0].numel() * buf.element_size()
        load.bytes += nbytes
        self.bytes_loaded += nbytes
        if self.timeline is not None:
            self.timeline.add(f"load L{layer}", "recv", t0, time.perf_counter_ns(), req=req_id, bytes=nbytes)
        return True

    def finished(self, load: OpenLoad) -> None:
        self._close(load.spec.req_id)

    def give_up(self, req_id: int) -> OpenLoad | None:
        self._close(req_id)                       # given up before it opened: nothing may wait for it
        return super().give_up(req_id)

    def _close(self, req_id: int) -> None:
        self.closed.add(req_id)
        for layer in range(self.num_layers):      # layers that came but were never copied
            self.landed.pop((req_id, layer), None)

    # ---- prefill side --------------------------------------------------------------------------
    def bind(self, meta: ConnectorMetadata) -> None:
        self._saves = list(meta.saves)

    def save_kv_layer(self, layer: int, pool) -> None:
        for spec in self._saves:
            if self.should_drop(spec.req_id, layer):
                continue                              # injected: this layer is lost on the way
            t0 = time.perf_counter_ns()
            ids = torch.tensor(spec.block_ids)
            kv = torch.stack([pool.k[layer][ids], pool.v[layer][ids]])   # a copy: the blocks may be freed
            header = torch.tensor([spec.req_id, layer, len(ids)])
            try:
                self.sending += [(dist.isend(header, DECODE_RANK), header), (dist.isend(kv, DECODE_RANK), kv)]
            except RuntimeError:
                self.save_errors += 1                 # the decode process is gone
                continue
            nbytes = kv.numel() * kv.element_size()
            self.bytes_saved += nbytes
            self.saved_at[spec.req_id] = time.perf_counter()
            if self.timeline is not None:
                self.timeline.add(f"save L{layer}", "send", t0, time.perf_counter_ns(), req=spec.req_id, bytes=nbytes)

    def wait_for_save(self) -> None:
        """The receiver thread takes every message as it comes, so the step's sends finish
        promptly; they are waited for here, so a tensor is never dropped while in flight."""
        self._saves = []
        for work, _ in self.sending:
            try:
                work.wait()
            except RuntimeError:
                self.save_errors += 1                 # the decode process is gone
        self.sending = []

    def receiver_stopped(self, timeout_s: float) -> bool:
        """The decode side, on close: wait for the prefill's STOP to end the receiver thread."""
        if self.receiver is not None:
            self.receiver.join(timeout_s)
        return self.receiver is None or not self.receiver.is_alive()

    def stop_receiver(self) -> None:
        """The prefill side, on close: end the decode process's receiver thread."""
        try:
            dist.send(torch.tensor([STOP, 0, 0]), DECODE_RANK)
        except RuntimeError:
            pass                                      # it is gone already
