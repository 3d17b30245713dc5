"""Where the linear layers keep their memory: one fixed-size slot per running sequence.

    attention layers (paged, lessons 12-15)        linear layers (this file)
    KV pool  [b0][b1][b2][b3][b4] ...               state pool, per linear layer:
    seq A table [b3, b0, b4]  grows every 16 tok      conv  [slots, C, K-1]     slot 0: seq A
    seq B table [b1]                                  delta [slots, Hv, dk, dv] slot 1: seq B
                                                      (same size at token 10 and at token 100,000)

A sequence takes a slot when it is admitted and gives it back when it finishes or is preempted
(StateSlots, the block manager's counterpart). A step reads and writes the slots of the
sequences it runs (RecurrentStep): prompt chunks one sequence at a time in the chunked form,
all one-token rows (decodes) together in the recurrent form. A sequence whose step starts at
position 0 starts from zeros, so a slot is never cleared: whatever a previous owner left in
it is simply not read.
"""
from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from step04_transformer.model import SingleSequenceAttention, StepAttention
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from advanced.adv13_linear_attention.config import HybridConfig
from advanced.adv13_linear_attention.gated_delta import (conv_decode, conv_prefill, delta_rule_chunked,
                                                         delta_rule_recurrent, prepare)


class StatePool:
    """The tensors: conv states in the model's dtype, delta states in float32 (they integrate
    every token of the sequence; vLLM also offers float32 for this state)."""

    def __init__(self, cfg: HybridConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        conv_shape, delta_shape = cfg.state_shapes()
        layers = len(cfg.linear_layers)
        self.conv = [torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.delta = [torch.zeros(num_slots, *delta_shape, dtype=torch.float32, device=device) for _ in range(layers)]
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.delta)

    @property
    def bytes_per_slot(self) -> int:
        """What one sequence's recurrent memory costs, whatever its length."""
        return self.nbytes // self.num_slots


class StateSlots:
    """The bookkeeping: which slot each running sequence holds, which are free."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self.slot_of: dict[int, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq: Sequence) -> int:
        if seq.seq_id in self.slot_of:
            raise RuntimeError(f"sequence {seq.seq_id} already holds state slot {self.slot_of[seq.seq_id]}")
        if not self.free_slots:
            raise RuntimeError(f"out of state slots: all {self.num_slots} are held")
        self.slot_of[seq.seq_id] = slot = self.free_slots.popleft()
        return slot

    def free(self, seq: Sequence) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)


class RecurrentStep:
    """One step's view of the state pool: which rows of the flat batch belong to which slot."""

    def __init__(self, pool: StatePool, segments: list[tuple[int, int, int]]):
        """segments: (slot, first position, tokens) per sequence, in the batch's row order."""
        self.pool = pool
        device = pool.delta[0].device if pool.delta else "cpu"
        rows, offset = [], 0
        self.prompts: list[tuple[int, int, int, int]] = []            # (slot, start, first row, tokens)
        single_slots, single_fresh = [], []
        for slot, start, n in segments:
            if n == 1:
                rows.append(offset)
                single_slots.append(slot)
                single_fresh.append(start == 0)
            else:
                self.prompts.append((slot, start, offset, n))
            offset += n
        self.single_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.single_slots = torch.tensor(single_slots, dtype=torch.long, device=device)
        self.single_fresh = torch.tensor(single_fresh, dtype=torch.bool, device=device)

    @classmethod
    def for_batch(cls, pool: StatePool, slots: StateSlots, batch: ScheduledBatch) -> "RecurrentStep":
        return cls(pool, [(slots.slot_of[s.seq_id], s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_tokens)])

    def _read(self, states: Tensor) -> Tensor:
        """The one-token rows' states; zeros for a sequence starting at position 0."""
        held = states[self.single_slots]
        return torch.where(self.single_fresh.view(-1, *[1] * (held.dim() - 1)), torch.zeros_like(held), held)

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        """x [T, C] -> silu(causal conv) [T, C], each sequence continuing from its conv state."""
        states, out = self.pool.conv[layer], torch.empty_like(x)
        if len(self.single_rows):
            o, new = conv_decode(x[self.single_rows], self._read(states), weight)
            out[self.single_rows] = o
            states.index_copy_(0, self.single_slots, new.to(states.dtype))
        for slot, start, row, n in self.prompts:
            o, new = conv_prefill(x[row:row + n], states[slot] if start else None, weight)
            out[row:row + n] = o
            states[slot] = new
        return out

    def delta(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """[T, H, d] inputs (g, beta [T, Hv]) -> outputs [T, Hv, dv]; the slots' delta states move on."""
        states, out = self.pool.delta[layer], torch.empty_like(v)
        if len(self.single_rows):
            r = self.single_rows
            o, new = delta_rule_recurrent(*prepare(q[r, None], k[r, None], v[r, None], g[r, None], beta[r, None]),
                                          self._read(states))
            out[r] = o[:, :, 0].to(out.dtype)
            states.index_copy_(0, self.single_slots, new)
        for slot, start, row, n in self.prompts:
            s = slice(row, row + n)
            initial = states[slot][None] if start else states.new_zeros(1, *states.shape[1:])
            o, new = delta_rule_chunked(*prepare(q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s]), initial)
            out[s] = o[0].transpose(0, 1).to(out.dtype)
            states[slot] = new[0]
        return out


class HybridStep:
    """What every layer of the hybrid model calls: attention layers call it like lesson 04's step
    attention (`step(kv_index, q, k, v)`), linear layers call `conv` and `delta`."""

    def __init__(self, attention: StepAttention, recurrent: RecurrentStep):
        self.attention, self.recurrent = attention, recurrent

    def __call__(self, kv_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attention(kv_index, q, k, v)

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        return self.recurrent.conv(layer, x, weight)

    def delta(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        return self.recurrent.delta(layer, q, k, v, g, beta)


def single_sequence_step(cfg: HybridConfig, num_tokens: int, like: Tensor) -> HybridStep:
    """All tokens are one sequence from position 0 (lesson 04's default), with a private slot."""
    pool = StatePool(cfg, 1, like.dtype, like.device)
    return HybridStep(SingleSequenceAttention(), RecurrentStep(pool, [(0, 0, num_tokens)]))
