"""The KV connector: what a prefill engine and a decode engine agree on, shaped like vLLM's
KV connector v1 (vllm/distributed/kv_transfer/kv_connector/v1/base.py), in two halves.

    scheduler side (plans; knows requests and block ids, never touches a tensor)
        get_num_new_matched_tokens(seq, num_computed)  how many prompt tokens the other side
                                                       holds for this request, beyond the local hit
        update_state_after_alloc(seq, num_external)    the blocks are allocated: plan their load
        build_connector_meta(batch)                    once per step: the loads to open and the
                                                       saves to make, handed to the worker side
        request_finished(seq)                          True: keep the blocks, a send still reads them

    worker side (moves bytes; knows the KV pool, never decides anything)
        start_load_kv(meta)                            open this step's loads
        wait_for_layer_load(req_id, layer, timeout_s)  that layer landed? copy it into the pool
        save_kv_layer(layer, pool)                     called by each layer's attention, right after
                                                       the layer wrote its K/V: ship that layer now
        wait_for_save()                                end of the forward: every save of the step out

The two halves talk only through `ConnectorMetadata`, so a scheduler in one process could drive
workers in others (vLLM's case with tensor parallelism). The transports (store.py, ...) implement
the worker side; the scheduler side is the same for all of them.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence


def prompt_key(prompt_ids: list[int], req_id: int) -> str:
    """Where a request's KV is found: the request id, then a hash of its prompt tokens (vLLM's
    SharedStorageConnector names its folders by such a hash). The loader checks the hash, so a
    decode engine never loads another prompt's KV by mistake."""
    digest = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]
    return f"r{req_id}-{digest}"


@dataclass
class LoadSpec:
    """Bring stored blocks [first_block, first_block + len(block_ids)) of a request into these blocks."""
    req_id: int
    key: str
    block_ids: list[int]
    first_block: int       # blocks before it are the decode engine's own prefix-cache hits
    num_tokens: int        # tokens whose K/V arrive


@dataclass
class SaveSpec:
    """Ship these blocks of a request (its whole prompt, computed this step)."""
    req_id: int
    key: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class TransferParams:
    """What the proxy attaches to a request (vLLM's kv_transfer_params): its key, and whether
    this engine produces the KV (prefill) or consumes it (decode)."""
    req_id: int
    key: str
    role: str              # "producer" | "consumer"


class ConnectorScheduler:
    """The scheduler side, one per engine. Pure bookkeeping: tested without any model."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.params: dict[int, TransferParams] = {}     # seq_id -> its transfer
        self._loads: list[LoadSpec] = []
        self.consumed: set[int] = set()                 # seq ids whose remote KV was used (or given up)

    def register(self, seq: Sequence, params: TransferParams) -> None:
        if params.role not in ("producer", "consumer"):
            raise ValueError(f"transfer role must be 'producer' or 'consumer', got {params.role!r}")
        self.params[seq.seq_id] = params

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed: int) -> int:
        """Prompt tokens the remote side holds beyond the `num_computed` found locally. Every
        prompt token but the last: the decode engine computes that one itself, which gives it
        the logits of its first token (lesson 13's prefix cache leaves it to compute likewise)."""
        p = self.params.get(seq.seq_id)
        if p is None or p.role != "consumer" or seq.seq_id in self.consumed:
            return 0
        return max(0, seq.num_prompt_tokens - 1 - num_computed)

    def update_state_after_alloc(self, seq: Sequence, num_external: int) -> None:
        """seq holds blocks for its prompt; plan to fill the ones the remote tokens fall in."""
        if num_external <= 0:
            return
        bs, start = self.block_size, seq.num_computed_tokens
        if start % bs:
            raise ValueError(f"local hit of {start} tokens is not a whole number of {bs}-token blocks")
        end = start + num_external
        first, last = start // bs, -(-end // bs)
        table = seq.block_table or []
        if len(table) < last:
            raise ValueError(f"seq {seq.seq_id} holds {len(table)} blocks, the load needs {last}")
        p = self.params[seq.seq_id]
        self._loads.append(LoadSpec(p.req_id, p.key, table[first:last], first, num_external))
        self.consumed.add(seq.seq_id)

    def build_connector_meta(self, batch: ScheduledBatch | None = None) -> ConnectorMetadata:
        """The step's metadata: loads planned since the last call; saves of every producer request
        whose prompt is complete after this step (its last chunk is in `batch`)."""
        meta = ConnectorMetadata(loads=self._loads)
        self._loads = []
        for seq, n in zip(batch.seqs, batch.num_tokens) if batch else ():
            p = self.params.get(seq.seq_id)
            if p is not None and p.role == "producer" and seq.num_computed_tokens + n == seq.num_prompt_tokens:
                meta.saves.append(SaveSpec(p.req_id, p.key, list(seq.block_table), seq.num_prompt_tokens))
        return meta

    def request_finished(self, seq: Sequence) -> bool:
        """Whether seq's blocks must outlive it. Our saves copy each layer's blocks out during
        the forward (save_kv_layer), so nothing reads them afterwards: False. A transport that
        lets the other side read the pool in place later (RDMA, NIXL in vLLM) answers True and
        frees the blocks when the read is reported done."""
        self.params.pop(seq.seq_id, None)
        self.consumed.discard(seq.seq_id)
        return False


@dataclass
class OpenLoad:
    """A load in progress on the worker side."""
    spec: LoadSpec
    opened: float = field(default_factory=time.perf_counter)
    next_layer: int = 0
    last_progress: float = field(default_factory=time.perf_counter)
    armed: bool = False         # the producer has started: a silence from here on is a fault
    producer_done: bool = False # the producer has shipped everything it will ever ship
    attempts: int = 1           # 2 after the transfer was asked for again (a retry)
    bytes: int = 0
    landed: list[float] = field(default_factory=list)   # when each layer was in the pool


class ConnectorWorker:
    """The worker side's interface; a transport fills in the layer methods."""

    def __init__(self, num_layers: int, transfer_timeout_s: float, drop_layers: set[tuple[int, int]] | None = None,
                 drop_once: set[tuple[int, int]] | None = None):
        """drop_layers: (request, layer) pairs the producer never ships; drop_once: pairs it skips
        the first time only (a retry then gets them): injected faults for the tests and run.py."""
        self.num_layers, self.transfer_timeout_s = num_layers, transfer_timeout_s
        self.drop_layers, self.drop_once = set(drop_layers or ()), set(drop_once or ())
        self.open: dict[int, OpenLoad] = {}
        # The launcher's news about a request can overtake its load: the decode process may
        # read "started" and "prefilled" in the same batch of messages as the request itself,
        # before the scheduler has given it blocks. Kept here, applied when the load opens.
        self.told: dict[int, str] = {}         # req id -> "started" | "done"

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for spec in meta.loads:
            self.open[spec.req_id] = OpenLoad(spec)
            news = self.told.pop(spec.req_id, None)
            if news == "started":
                self.arm(spec.req_id)
            elif news == "done":
                self.producer_done(spec.req_id)

    def wait_for_layer_load(self, req_id: int, layer: int, timeout_s: float = 0.0) -> bool:
        raise NotImplementedError

    def save_kv_layer(self, layer: int, pool) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError

    # the prefill side is given the step's saves before the forward (vLLM: bind_connector_metadata)
    def bind(self, meta: ConnectorMetadata) -> None:
        raise NotImplementedError

    def finished(self, load: OpenLoad) -> None:
        """A load is over (complete or given up): release what the transport kept for it."""

    def should_drop(self, req_id: int, layer: int) -> bool:
        """The producer side: is this layer lost on the way (an injected fault)?"""
        if (req_id, layer) in self.drop_once:
            self.drop_once.discard((req_id, layer))
            return True
        return (req_id, layer) in self.drop_layers

    def reopen(self, load: OpenLoad) -> None:
        """Ask again: the load goes back to waiting for its producer, from the first layer it
        lacks (the layers already copied stay in the pool). The producer's second attempt arms
        it again with its own "started" and "prefilled"."""
        self.told.pop(load.spec.req_id, None)
        load.armed = load.producer_done = False
        load.attempts += 1
        load.last_progress = time.perf_counter()
        self.open[load.spec.req_id] = load

    # ---- transport-independent: driving the open loads, once per engine step ------------------
    # True: every layer the producer ships is readable here before it reports the request done
    # (the store's writes return when the file is in place); False: layers may still be on the
    # way (gloo's sends finish later), so only the timeout can declare one lost.
    lands_before_done: bool = True

    def arm(self, req_id: int) -> None:
        """The producer has started this request: from now on, a layer that takes longer than
        transfer_timeout_s after the previous one is lost."""
        load = self.open.get(req_id)
        if load is None:
            self.told.setdefault(req_id, "started")
        elif not load.armed:
            load.armed, load.last_progress = True, time.perf_counter()

    def progress(self, wait_s: float = 0.0) -> tuple[list[OpenLoad], dict[int, tuple[OpenLoad, str]]]:
        """Copy every layer that has landed into the pool, in layer order. Returns the loads now
        complete and the ones given up (with why). wait_s: how long to wait for the next layer
        when nothing else is to be done (an idle decode engine)."""
        done, failed = [], {}
        for req_id, load in list(self.open.items()):
            try:
                while load.next_layer < self.num_layers and self.wait_for_layer_load(req_id, load.next_layer, wait_s):
                    load.next_layer += 1
                    load.last_progress = time.perf_counter()
                    load.landed.append(load.last_progress)
                    wait_s = 0.0                          # waited once this call: enough
            except TransferError as e:
                failed[req_id] = (self.open.pop(req_id), str(e))
                continue
            if load.next_layer == self.num_layers:
                done.append(self.open.pop(req_id))
            elif load.producer_done and self.lands_before_done:
                failed[req_id] = (self.open.pop(req_id), f"layer {load.next_layer} never arrived "
                                                         "(the prefill engine has finished the request)")
            elif load.armed and time.perf_counter() - load.last_progress > self.transfer_timeout_s:
                failed[req_id] = (self.open.pop(req_id), f"layer {load.next_layer} did not arrive within "
                                                         f"{self.transfer_timeout_s:g} s")
        return done, failed

    def producer_done(self, req_id: int) -> None:
        """The producer finished the request: every layer it sent is already there."""
        load = self.open.get(req_id)
        if load is None:
            self.told[req_id] = "done"
        else:
            load.producer_done = True
            if not load.armed:
                load.armed, load.last_progress = True, time.perf_counter()

    def give_up(self, req_id: int) -> OpenLoad | None:
        """Stop waiting for this load (its producer is gone); returns it, or None if not open."""
        self.told.pop(req_id, None)
        return self.open.pop(req_id, None)


class TransferError(RuntimeError):
    """A layer arrived broken (wrong prompt, wrong shape): the load cannot finish."""
