"""A linear layer that adds each row's own LoRA delta: many adapters in one batched forward.

    x [T, in] --base W (shared by every request)--------------------------> y [T, out]
         |                                                                    ^ +=
         '--rows of adapter s--> shrink x A_s^T [n, r_s] --> expand @ B_s^T --'

The adapters resident in the engine sit in `max_loras` *slots*: every LoRALinear holds
A for all slots in one tensor [slots, max_rank, in] and B^T (scaling folded in) in another
[slots, max_rank, out], zero-padded past each adapter's rank. A step's rows know their slot
(-1: the base model alone); two ways to compute the deltas, as Punica's two kernels:

  segments  (SGMV)  rows sorted by slot; per slot present, one shrink and one expand matmul
                    over that slot's rows: a Python loop over the adapters in the batch, never
                    over tokens. Work = the rows' own ranks; cost grows with adapters present.
  stacked   (BGMV)  every row against every slot at once: x @ [A_0 | A_1 | ...]^T, zero
                    all but the row's own slot's r columns, @ [B_0^T; B_1^T; ...]: two matmuls
                    per layer whatever the number of adapters, at S x the shrink work (S: the
                    slots up to the highest in use; a rank-8 adapter among rank-16 slots pays
                    for its zero padding too). Made for decode steps (few rows); a prompt
                    chunk of 500 rows would pay S x its shrink work.

A row without an adapter gets nothing added (segments) or + 0.0 (stacked): its numbers are the base's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from step14_batched_forward.packed_linear import replace_modules

from .adapters import TARGET_MODULES

STRATEGIES = ("auto", "segments", "stacked")


@dataclass
class LoRAMapping:
    """One step's rows grouped by slot: what every LoRALinear of the step reads."""
    order: Tensor                          # [N] rows that use an adapter, sorted by slot
    segments: list[tuple[int, int, int]]   # (slot, start, end): order[start:end] use that slot
    onehot: Tensor | None = None           # stacked: [T, S, 1], 1 at each row's slot (S: highest used + 1)

    @classmethod
    def build(cls, row_slots: Tensor, stacked: bool, dtype: torch.dtype) -> "LoRAMapping | None":
        """row_slots [T]: each row's slot, -1 for the base model. None: no row uses an adapter."""
        rows = (row_slots >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        sorted_slots, perm = torch.sort(row_slots[rows], stable=True)       # the SGMV grouping
        slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        ends = counts.cumsum(0).tolist()
        segments = [(s, e - c, e) for s, c, e in zip(slots.tolist(), counts.tolist(), ends)]
        onehot = None
        if stacked:
            # Only slots 0 .. highest used take part (slots are handed out lowest first).
            used = segments[-1][0] + 1
            onehot = torch.zeros(row_slots.numel(), used + 1, dtype=dtype)
            onehot[torch.arange(row_slots.numel()), row_slots] = 1        # -1 lands in the extra column
            onehot = onehot[:, :used, None]
        return cls(rows[perm], segments, onehot)


class LoRAState:
    """What all LoRALinears of one model share: the step's mapping (set by the engine)."""

    def __init__(self):
        self.mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, out_features: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, state: LoRAState):
        super().__init__()
        self.base, self.state = base, state
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, in_features, dtype=dtype), persistent=False)
        self.register_buffer("lora_bt", torch.zeros(max_loras, max_rank, out_features, dtype=dtype),
                             persistent=False)
        self.ranks = [0] * max_loras        # 0: this slot's adapter does not adapt this linear

    def set_slot(self, slot: int, a: Tensor | None, bt: Tensor | None) -> None:
        """Write an adapter's A [r, in] and B^T [r, out] into `slot` (None: clear it)."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()           # zero padding: the stacked path reads all max_rank rows
        self.ranks[slot] = 0 if a is None else a.shape[0]
        if a is not None:
            self.lora_a[slot, :a.shape[0]].copy_(a)
            self.lora_bt[slot, :a.shape[0]].copy_(bt)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        m = self.state.mapping
        if m is None or not any(self.ranks[slot] for slot, _, _ in m.segments):
            return y                                  # no adapter of this step adapts this projection
        if m.onehot is not None:                                  # stacked: two matmuls, all slots
            S, R = m.onehot.shape[1], self.lora_a.shape[1]        # slots 0..S-1: a leading slice, no copy
            shrink = x @ self.lora_a[:S].view(S * R, -1).t()      # [T, S*R]: every row, every slot
            shrink = (shrink.view(-1, S, R) * m.onehot).view(-1, S * R)
            return y.add_(shrink @ self.lora_bt[:S].view(S * R, -1))
        xs = x.index_select(0, m.order)                           # rows grouped by slot
        delta = torch.zeros(xs.shape[0], self.out_features, dtype=y.dtype)
        for slot, start, end in m.segments:                       # segments: one pair per adapter
            r = self.ranks[slot]
            if r:
                torch.matmul(xs[start:end] @ self.lora_a[slot, :r].t(), self.lora_bt[slot, :r], out=delta[start:end])
        return y.index_add_(0, m.order, delta)                    # back to the rows' places


def add_lora_layers(model: nn.Module, max_loras: int, max_rank: int
                    ) -> tuple[nn.Module, dict[tuple[int, str], LoRALinear], LoRAState]:
    """`model` with every q/k/v/o/gate/up/down projection of every layer wrapped in a LoRALinear
    (a new model: `model` is left as it was, lesson 14's replace_modules). Returns the model,
    its LoRALinears by (layer, module name), and the state they share. The projections may be
    nn.Linear or lesson 14's PackedLinear: both say in_features and out_features."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
    targets: dict[int, tuple[int, str]] = {}                  # id(projection) -> (layer, name)
    for i, layer in enumerate(model.model.layers):
        for name, parent in TARGET_MODULES.items():
            proj = getattr(getattr(layer, parent), name, None)
            if proj is None:
                raise TypeError(f"layer {i} has no {parent}.{name} (fused by lesson 16's fast path?): "
                                "LoRA layers go on a model with separate projections")
            targets[id(proj)] = (i, name)
    state, dtype = LoRAState(), model.model.embed_tokens.weight.dtype
    layers: dict[tuple[int, str], LoRALinear] = {}

    def wrap(m: nn.Module) -> nn.Module | None:
        key = targets.get(id(m))
        if key is None:
            return None
        layers[key] = LoRALinear(m, m.in_features, m.out_features, max_loras, max_rank, dtype, state)
        return layers[key]
    return replace_modules(model, wrap), layers, state
