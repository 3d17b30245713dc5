"""Rank 0's forward: the attention halves here, the FFN halves on the FFN ranks, micro-batches ping-ponging.

    m = 1:  rank 0  |attn L0|.....wait.....|attn L1|.....wait.....|attn L2|
            FFN     |.......|FFN L0|.......|.......|FFN L1|.......|
                    each side idles while the other works

    m = 2:  rank 0  |attn L0 A|attn L0 B|attn L1 A|attn L1 B|attn L2 A|
            FFN     |.........|FFN L0 A |FFN L0 B |FFN L1 A |FFN L1 B |
                    while the FFN works on A's layer l, rank 0 works on B's layer l (or A's l+1)

For each layer l and each micro-batch i, in that order: wait for i's FFN output of layer l-1
(it became i's input), run i's attention half of layer l, `isend` the result to i's FFN rank and
post the `irecv` of what comes back, and go on to the next micro-batch at once. Each micro-batch
has its own step attention (lesson 15's `FlashPagedAttention` over its own sequences): it reads
and writes only its sequences' KV blocks, so the micro-batches never wait on each other's KV.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
from torch import Tensor

from minivllm_support.timeline import Timeline
from step09_continuous_batching.scheduler import ScheduledBatch
from step15_flash_attention.attention import FlashPagedAttention
from step15_flash_attention.engine import ModelRunner
from advanced.adv06_pipeline_parallel import p2p
from advanced.adv11_afd.microbatch import StepPlan, ffn_rank, split_batch
from advanced.adv11_afd.split import attention_half


@dataclass
class Traffic:
    """What rank 0 sent and received: hidden states per layer both ways, and the per-step plans."""
    to_ffn: int = 0
    from_ffn: int = 0
    plan: int = 0
    exchanges: int = 0            # one per layer per micro-batch: a send and a receive
    layer_tokens: int = 0         # tokens x layers that crossed (for bytes per token per layer)

    def reset(self) -> None:
        self.to_ffn = self.from_ffn = self.plan = self.exchanges = self.layer_tokens = 0


@dataclass
class _Pending:
    """An FFN result on its way back: the receive, its buffer, when the send started."""
    work: object
    buf: Tensor
    dst: int
    layer: int
    sent_ns: int


class AFDRunner(ModelRunner):
    def __init__(self, model, pool, backend, conns: list[Connection], n_ffn: int, timeout_s: float,
                 timeline: Timeline, num_micro_batches: int = 2):
        super().__init__(model)
        self.pool, self.backend, self.conns, self.n_ffn = pool, backend, conns, n_ffn
        self.timeout_s, self.timeline, self.m = timeout_s, timeline, num_micro_batches
        self.traffic, self.steps = Traffic(), 0

    def forward(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor, attn=None) -> Tensor:
        tl, model, step = self.timeline, self.model, self.steps
        self.steps += 1
        mbs = split_batch(batch, self.m)
        layers = model.model.layers
        plan = StepPlan(step, len(layers), [mb.tokens for mb in mbs]).to_bytes()
        for conn in self.conns:                 # every FFN rank learns the step's shape, even one with no part
            conn.send_bytes(plan)
        self.traffic.plan += len(plan) * len(self.conns)
        with tl.span("embed", "compute", step=step):
            cos, sin = model.rotary(positions)
            x = model.model.embed_tokens(input_ids)
        xs = [x[mb.start:mb.end] for mb in mbs]
        rope = [(cos[mb.start:mb.end], sin[mb.start:mb.end]) for mb in mbs]
        attns = [FlashPagedAttention(self.pool, mb.batch, self.backend) for mb in mbs]
        pending: list[_Pending | None] = [None] * len(mbs)
        sends: deque = deque()                  # (work, tensor): a tensor must outlive its send
        for l, layer in enumerate(layers):
            for mb in mbs:
                i = mb.index
                if pending[i] is not None:
                    xs[i] = self._receive(pending[i], step, i)
                with tl.span(f"attn L{l} mb{i}", "compute", step=step, layer=l, micro_batch=i, tokens=mb.tokens,
                             kv_tokens=mb.kv_tokens):
                    h = attention_half(layer, xs[i], *rope[i], attns[i]).contiguous()
                dst, nbytes = ffn_rank(i, self.n_ffn), h.numel() * h.element_size()
                with tl.span("send h", "send", step=step, layer=l, micro_batch=i, bytes=nbytes):
                    while sends and sends[0][0].is_completed():
                        sends.popleft()
                    sent_ns = time.perf_counter_ns()
                    sends.append((p2p.isend(h, dst), h))
                    buf = torch.empty_like(h)
                    pending[i] = _Pending(p2p.irecv(buf, dst), buf, dst, l, sent_ns)
                self.traffic.to_ffn += nbytes
                self.traffic.from_ffn += nbytes
                self.traffic.exchanges += 1
                self.traffic.layer_tokens += mb.tokens
        xs = [self._receive(p, step, i) for i, p in enumerate(pending)]
        while sends:
            p2p.wait(sends.popleft()[0], f"a send of step {step} to the FFN side", self.timeout_s)
        with tl.span("final norm", "compute", step=step):
            return model.model.norm(torch.cat(xs) if len(xs) > 1 else xs[0])

    def _receive(self, p: _Pending, step: int, i: int) -> Tensor:
        """Wait for micro-batch i's FFN output; the span's round trip runs from its send's start."""
        with self.timeline.span("wait FFN", "recv", step=step, layer=p.layer, micro_batch=i) as args:
            p2p.wait(p.work, f"FFN output of step {step} layer {p.layer} micro-batch {i} from rank {p.dst}",
                     self.timeout_s)
            args["round_trip_us"] = (time.perf_counter_ns() - p.sent_ns) / 1e3
        return p.buf
