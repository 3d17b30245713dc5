"""Transport 1: a shared folder of files, one per (request, layer), like vLLM's SharedStorageConnector.

    <root>/<key>/L000.kv    layer 0's K and V of every block of the request's prompt
    <root>/<key>/L001.kv    layer 1's ...                 (key = request id + prompt hash)

The prefill engine writes a layer's file the moment that layer's attention has written its K/V
(inside the forward), so layer 0 is on disk while layer 1 is still being computed. A file is
written under a temporary name and renamed: a rename is atomic, so a reader sees a whole layer or
no layer, never half of one. The decode engine polls for the next layer it needs and copies it
into its own pool, block for block, into the blocks its scheduler allocated.

On one machine the root is under /dev/shm (memory, not disk); across machines it would be a
shared file system (vLLM's connector is used with NFS or a parallel file system that way).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from advanced.adv10_pd_disaggregation.connector import (ConnectorMetadata, ConnectorWorker, OpenLoad, SaveSpec,
                                                        TransferError)

POLL_S = 0.001       # how often a waiting reader looks for the next layer's file


def default_root() -> Path:
    """A fresh folder in shared memory where there is one (Linux), else in the temp folder."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="minivllm-pd-", dir=base))


class KVStore:
    """The folder; what is in a file and how it lands."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"KV store folder {self.root} does not exist")

    def layer_path(self, key: str, layer: int) -> Path:
        return self.root / key / f"L{layer:03d}.kv"

    def write_layer(self, key: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write a layer's blocks [n, ...] of K and V; returns the tensor bytes written."""
        path = self.layer_path(key, layer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"key": key, "layer": layer, "k": k, "v": v}, tmp)
        os.replace(tmp, path)                      # atomic: the reader sees all of it or nothing
        return k.numel() * k.element_size() + v.numel() * v.element_size()

    def read_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's (K, V), or None while it has not landed."""
        try:
            data = torch.load(self.layer_path(key, layer), weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged file: the load fails, with its reason
            raise TransferError(f"{key} layer {layer}: unreadable ({type(e).__name__}: {e})") from e
        if data.get("key") != key or data.get("layer") != layer:
            raise TransferError(f"{key} layer {layer}: the file holds {data.get('key')} layer {data.get('layer')}")
        return data["k"], data["v"]

    def remove(self, key: str) -> None:
        shutil.rmtree(self.root / key, ignore_errors=True)

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())


class StoreConnectorWorker(ConnectorWorker):
    """The worker side over a KVStore. drop_layers / drop_once: (request, layer) pairs never
    written / skipped once, to inject a lost transfer (the tests and run.py's fault mode use them)."""

    def __init__(self, store: KVStore, pool, num_layers: int, transfer_timeout_s: float = 10.0,
                 drop_layers: set[tuple[int, int]] | None = None, timeline=None,
                 drop_once: set[tuple[int, int]] | None = None):
        super().__init__(num_layers, transfer_timeout_s, drop_layers, drop_once)
        self.store, self.pool = store, pool
        self._saves: list[SaveSpec] = []
        self.bytes_saved = self.bytes_loaded = self.save_errors = 0
        self.saved_at: dict[int, float] = {}      # request -> when its latest layer was handed over
        self.timeline = timeline

    # ---- decode side ---------------------------------------------------------------------------
    def wait_for_layer_load(self, req_id: int, layer: int, timeout_s: float = 0.0) -> bool:
        load = self.open[req_id]
        spec, deadline = load.spec, time.perf_counter() + timeout_s
        t0 = time.perf_counter_ns()
        while (got := self.store.read_layer(spec.key, layer)) is None:
            if time.perf_counter() >= deadline:
                return False
            time.sleep(POLL_S)                    # a reader's wait for a file, not simulated work
        k, v = got
        n, first = len(spec.block_ids), spec.first_block
        want = (first + n, *self.pool.k[layer].shape[1:])
        if k.shape[0] < first + n or k.shape[1:] != self.pool.k[layer].shape[1:] or k.dtype != self.pool.k[layer].dtype:
            raise TransferError(f"{spec.key} layer {layer}: got {tuple(k.shape)} {k.dtype}, need {want} "
                                f"{self.pool.k[layer].dtype}")
        ids = torch.tensor(spec.block_ids, device=self.pool.k[layer].device)
        self.pool.k[layer].index_copy_(0, ids, k[first:first + n].to(self.pool.k[layer].device))
        self.pool.v[layer].index_copy_(0, ids, v[first:first + n].to(self.pool.v[layer].device))
        nbytes = 2 * n * k[0].numel() * k.element_size()
        load.bytes += nbytes
        self.bytes_loaded += nbytes
        if self.timeline is not None:
            self.timeline.add(f"load L{layer}", "recv", t0, time.perf_counter_ns(), req=req_id, bytes=nbytes)
        return True

    def finished(self, load: OpenLoad) -> None:
        """The load is over (complete or given up): its files are no longer needed."""
        self.store.remove(load.spec.key)

    def reopen(self, load: OpenLoad) -> None:
        """Asked again: the files of the first attempt go (a damaged one would fail the retry
        too); the producer writes every layer anew, and the layers from next_layer on are read."""
        self.store.remove(load.spec.key)
        super().reopen(load)

    # ---- prefill side --------------------------------------------------------------------------
    def bind(self, meta: ConnectorMetadata) -> None:
        """The step's saves; each layer's attention then calls save_kv_layer."""
        self._saves = list(meta.saves)

    def save_kv_layer(self, layer: int, pool) -> None:
        for spec in self._saves:
            if self.should_drop(spec.req_id, layer):
                continue                              # injected: this layer is lost on the way
            t0 = time.perf_counter_ns()
            ids = torch.tensor(spec.block_ids, device=pool.k[layer].device)
            try:                                      # indexing copies the blocks out of the pool
                nbytes = self.store.write_layer(spec.key, layer, pool.k[layer][ids].cpu(), pool.v[layer][ids].cpu())
            except OSError:
                self.save_errors += 1                 # the reader gave up and removed the folder
                continue
            self.bytes_saved += nbytes
            self.saved_at[spec.req_id] = time.perf_counter()
            if self.timeline is not None:
                self.timeline.add(f"save L{layer}", "send", t0, time.perf_counter_ns(), req=spec.req_id, bytes=nbytes)

    def wait_for_save(self) -> None:
        self._saves = []                              # the writes above are done when they return
