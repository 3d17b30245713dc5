"""Which adapters are resident: `max_loras` slots, filled on demand, least recently used evicted.

    registered (name -> folder)      slots (max_loras, each in every LoRALinear)
    "sql"    -> /adapters/sql        [0] "sql"     <- in the running batch: pinned
    "french" -> /adapters/french     [1] "pirate"  <- idle, least recently used: next to go
    "pirate" -> /adapters/pirate     [2] "french"
    "legal"  -> /adapters/legal      a request for "legal": evict "pirate", load "legal" into [1]

vLLM's --max-loras is the same knob: the slot tensors are sized for it once, so serving more
adapters than slots costs loads (disk -> slot copies), never memory. An adapter used by a
running sequence is never evicted; when every slot is pinned, the request waits in the
scheduler until a slot frees (engine.py).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from step04_transformer.config import ModelConfig

from .adapters import TARGET_MODULES, LoRAAdapter, LoRARequest, load_adapter
from .lora_linear import LoRALinear, LoRAMapping, LoRAState


@dataclass
class LoRAStats:
    resident: list[str]        # least recently used first
    loads: int                 # adapters copied into a slot
    evictions: int             # adapters pushed out of a slot to make room
    load_seconds: float        # time spent reading folders and filling slots


class LoRAManager:
    def __init__(self, layers: dict[tuple[int, str], LoRALinear], state: LoRAState, config: ModelConfig,
                 max_loras: int, max_rank: int, dtype: torch.dtype):
        self.layers, self.state, self.dtype = layers, state, dtype
        self.max_loras, self.max_rank, self.num_layers = max_loras, max_rank, config.num_layers
        first = {name: layers[(0, name)] for name in TARGET_MODULES}
        self.shapes = {name: (m.in_features, m.out_features) for name, m in first.items()}
        self.registered: dict[str, LoRARequest] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()      # name -> slot, least recent first
        self.free_slots = list(range(max_loras))
        self.loads = self.evictions = 0
        self.load_seconds = 0.0

    # ---- the adapters a request may name -------------------------------------------------
    def register(self, request: LoRARequest) -> None:
        """Check the folder (every tensor read and fitted to the model) and remember it by name.
        Registering the same request again is a no-op; another folder or id under a taken name is an error."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.registered.get(request.lora_name)
        if known == request:
            return
        if known is not None:
            raise ValueError(f"LoRA name {request.lora_name!r} is already registered as {known}")
        same_id = [r for r in self.registered.values() if r.lora_int_id == request.lora_int_id]
        if same_id:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already used by {same_id[0].lora_name!r}")
        adapter = self._read(request)
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}; this engine's "
                             f"max_lora_rank is {self.max_rank}")
        self.registered[request.lora_name] = request

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        return load_adapter(request, self.shapes, self.num_layers, self.dtype)

    def check_known(self, name: str) -> None:
        if name not in self.registered:
            raise ValueError(f"unknown LoRA adapter {name!r} (registered: {sorted(self.registered) or 'none'})")

    # ---- slots -----------------------------------------------------------------------------
    def can_place(self, name: str | None, pinned: set[str]) -> bool:
        """Could `name` be in a slot now: resident, a free slot, or an idle adapter to evict."""
        if name is None or name in self.resident or self.free_slots:
            return True
        return any(n not in pinned for n in self.resident)

    def acquire(self, name: str, pinned: set[str]) -> int:
        """`name`'s slot, loading it (and evicting the least recently used adapter not in `pinned`) if needed."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        if not self.free_slots:
            victim = next((n for n in self.resident if n not in pinned), None)
            if victim is None:
                raise RuntimeError(f"no LoRA slot for {name!r}: all {self.max_loras} hold adapters of running "
                                   "requests (the scheduler checks can_place first)")
            self._clear(self.resident.pop(victim))
            self.evictions += 1
        slot = self.free_slots.pop(0)
        start = time.perf_counter()
        adapter = self._read(self.registered[name])
        for key, layer in self.layers.items():
            a, bt = adapter.weights.get(key, (None, None))
            layer.set_slot(slot, a, bt)
        self.load_seconds += time.perf_counter() - start
        self.loads += 1
        self.resident[name] = slot
        return slot

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None, None)
        self.free_slots.append(slot)

    def touch(self, names: set[str]) -> None:
        """The adapters of this step's batch become the most recently used."""
        for name in names:
            self.resident.move_to_end(name)

    # ---- one step ----------------------------------------------------------------------------
    def set_step(self, names: list[str | None], num_tokens: list[int], stacked: bool) -> None:
        """The step's mapping for the LoRALinears: sequence i (adapter names[i], None: the base)
        has num_tokens[i] consecutive rows."""
        per_seq = torch.tensor([-1 if n is None else self.resident[n] for n in names])
        slots = torch.repeat_interleave(per_seq, torch.tensor(num_tokens))
        self.state.mapping = LoRAMapping.build(slots, stacked, self.dtype)

    def clear_step(self) -> None:
        self.state.mapping = None

    def stats(self) -> LoRAStats:
        return LoRAStats(list(self.resident), self.loads, self.evictions, self.load_seconds)
