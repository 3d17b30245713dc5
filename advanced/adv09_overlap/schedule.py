"""The two-batch overlap schedule: each micro-batch's all-reduce runs while the other computes.

Lesson 17's layer waits for every all-reduce it starts (RowParallelLinear reduces inside its
forward). Here o_proj and down_proj only compute their rank's partial sum (PartialSum) and the
schedule starts the all-reduce asynchronously (gloo's own threads carry it), then runs the other
micro-batch's next piece of work before it waits:

    compute thread   |A attn L0|B attn L0|wait A|A mlp L0|wait B|B mlp L0|wait A|A attn L1|...
    gloo (A)                   |== reduce A ==|          |=== reduce A ===|
    gloo (B)                             |=== reduce B ===|          |=== reduce B ===|

A lane is one micro-batch on its way through the layers: its residual stream, its slice of
the step attention, and the all-reduce it has in flight. Each half layer of a lane is: wait
for its last all-reduce and add it to the residual, compute (norm, attention or MLP, the
row-parallel matmul), start the next all-reduce. With one lane (a step of one sequence, or
overlap off) the wait follows the start at once: lesson 17's schedule, the same sums.

The all-reduce of two ranks adds two partials, the same two in either schedule, so the split
changes no bits there; the matmuls run on fewer rows (fp32 results are compared in the tests).
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from step14_batched_forward.packed_linear import replace_modules
from step17_tensor_parallel import parallel
from step17_tensor_parallel.layers import RowParallelLinear
from step17_tensor_parallel.parallel import CollectiveError
from advanced.adv09_overlap.recorder import StepRecorder
from advanced.adv09_overlap.split import MicroBatch, SubBatchAttention, q_lens_of, split_micro_batches


class PartialSum(nn.Module):
    """A RowParallelLinear that hands its rank's partial sum to the schedule instead of reducing it."""

    def __init__(self, row: RowParallelLinear):
        super().__init__()
        if row.bias is not None:    # a bias belongs after the sum, which the schedule does not add
            raise ValueError("PartialSum: a row-parallel linear with a bias cannot defer its all-reduce")
        self.linear = row.linear

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def defer_reductions(model: nn.Module) -> nn.Module:
    """`model` with every RowParallelLinear (o_proj, down_proj) replaced by a PartialSum (a new
    model, lesson 14's replace_modules: the weights are shared, not copied)."""
    return replace_modules(model, lambda m: PartialSum(m) if isinstance(m, RowParallelLinear) else None)


@dataclass
class InFlight:
    """An all-reduce started and not yet waited for; done_ns is stamped by gloo's thread."""
    tensor: Tensor
    work: dist.Work
    issued_ns: int
    name: str
    layer: int
    done_ns: list[int] = field(default_factory=list)


def start_all_reduce(x: Tensor, name: str, layer: int) -> InFlight:
    t0 = time.perf_counter_ns()
    try:
        work = dist.all_reduce(x, async_op=True)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on a closed pair
        raise CollectiveError(f"all-reduce {name} failed to start: {e}") from e
    flight = InFlight(x, work, t0, name, layer)
    # When the sum is complete: a callback on gloo's side, so the timeline shows when the bytes
    # are really done, not only when this thread comes back to wait for them.
    work.get_future().then(lambda _: flight.done_ns.append(time.perf_counter_ns()))
    return flight


def finish_all_reduce(flight: InFlight, timeout_s: float, rec: StepRecorder, mb: str) -> Tensor:
    t0 = time.perf_counter_ns()
    try:
        flight.work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - a dead or silent rank: gloo's error or its timeout
        raise CollectiveError(f"all-reduce {flight.name} failed: {e}") from e
    t1 = time.perf_counter_ns()
    done = min(flight.done_ns[0], t1) if flight.done_ns else t1
    nbytes = flight.tensor.numel() * flight.tensor.element_size()
    rec.add_wait(mb, t0, t1, flight.layer)
    rec.add_all_reduce(mb, flight.name, flight.issued_ns, max(done, flight.issued_ns), nbytes, flight.layer)
    parallel.COMM.seconds += (t1 - t0) / 1e9          # the time this rank sat waiting for it
    parallel.COMM.calls += 1
    parallel.COMM.bytes += nbytes
    return flight.tensor


@dataclass
class Lane:
    mb: MicroBatch
    x: Tensor                       # the residual stream of its rows
    cos: Tensor
    sin: Tensor
    attn: object                    # its step attention
    pending: InFlight | None = None

    def settle(self, timeout_s: float, rec: StepRecorder) -> None:
        """Wait for the lane's all-reduce in flight and add the sum to its residual stream."""
        if self.pending is not None:
            self.x = self.x + finish_all_reduce(self.pending, timeout_s, rec, self.mb.name)
            self.pending = None


def attention_half(layer, lane: Lane) -> Tensor:
    return layer.self_attn(layer.input_layernorm(lane.x), lane.cos, lane.sin, lane.attn)


def mlp_half(layer, lane: Lane) -> Tensor:
    return layer.mlp(layer.post_attention_layernorm(lane.x))


HALVES: list[tuple[str, Callable]] = [("attn", attention_half), ("mlp", mlp_half)]


def run_layers(model, input_ids: Tensor, positions: Tensor, attn, overlap: bool, rec: StepRecorder,
               timeout_s: float) -> Tensor:
    """Lesson 04's forward (embed, layers, final norm) of a PartialSum model, the layers in
    the overlap schedule when `overlap` and the step has two sequences or more."""
    mbs = split_micro_batches(q_lens_of(attn), overlap)
    with rec.compute("embed", "all", tokens=len(input_ids)):
        cos, sin = model.rotary(positions)
        x = model.model.embed_tokens(input_ids)          # its all-reduce: synchronous, once a step
    lanes = []
    for mb in mbs:
        rows = slice(mb.rows.start, mb.rows.stop)
        lanes.append(Lane(mb, x[rows], cos[rows], sin[rows], attn if len(mbs) == 1 else SubBatchAttention(attn, mb)))
    for i, layer in enumerate(model.model.layers):
        for half, run in HALVES:
            for lane in lanes:
                lane.settle(timeout_s, rec)
                with rec.compute(f"{lane.mb.name} {half} L{i}", lane.mb.name, layer=i, tokens=lane.mb.num_tokens):
                    partial = run(layer, lane)
                lane.pending = start_all_reduce(partial, f"{lane.mb.name} {half} L{i}", i)
    for lane in lanes:
        lane.settle(timeout_s, rec)
    x = lanes[0].x if len(lanes) == 1 else torch.cat([lane.x for lane in lanes])
    with rec.compute("final norm", "all"):
        return model.model.norm(x)
