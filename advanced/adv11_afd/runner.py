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

With two attention workers (2:1) the step's sequences are first split by `owner`: rank 0 runs
the layers of its own, the peer (peer.py) those of the others with the same `layers` loop, and
the one FFN rank gathers micro-batch i of both into one MLP call.
"""
from __future__ import annotations

import pickle
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
from advanced.adv11_afd.microbatch import MicroBatch, StepPlan, attention_rank, ffn_rank, owner, split_batch
from advanced.adv11_afd.split import attention_half


@dataclass
class Traffic:
    """What rank 0 sent and received: hidden states per layer both ways, and the per-step plans."""
    to_ffn: int = 0
    from_ffn: int = 0
    plan: int = 0
    exchanges: int = 0            # one per layer per micro-batch: a send and a receive
    layer_tokens: int = 0         # tokens x layers that crossed (for bytes per token per layer)
    from_peers: int = 0           # 2:1: the other attention rank's last hidden rows, once per step

    def reset(self) -> None:
        self.to_ffn = self.from_ffn = self.plan = self.exchanges = self.layer_tokens = self.from_peers = 0


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
                 timeline: Timeline, num_micro_batches: int = 2, n_attention: int = 1):
        """conns: rank 0's control sockets in rank order (FFN ranks first, then the other attention
        ranks). n_attention: attention workers (rank 0 and n_attention - 1 peers, peer.py)."""
        super().__init__(model)
        self.pool, self.backend, self.conns, self.n_ffn = pool, backend, conns, n_ffn
        self.timeout_s, self.timeline, self.m, self.n_attention = timeout_s, timeline, num_micro_batches, n_attention
        self.traffic, self.steps = Traffic(), 0

    def forward(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor, attn=None) -> Tensor:
        step = self.steps
        self.steps += 1
        parts = split_by_owner(batch, self.n_attention)
        mbs = [split_batch(part, self.m) for part, _ in parts]
        plan = StepPlan(step, len(self.model.model.layers), [[mb.tokens for mb in mine] for mine in mbs]).to_bytes()
        for conn in self.conns[:self.n_ffn]:    # every FFN rank learns the step's shape, even one with no part
            conn.send_bytes(plan)
        self.traffic.plan += len(plan) * self.n_ffn
        if self.n_attention == 1:
            x = self.layers(mbs[0], input_ids, positions, step)
        else:
            x = self._with_peers(parts, mbs[0], input_ids, positions, step)
        with self.timeline.span("final norm", "compute", step=step):
            return self.model.model.norm(x)

    def _with_peers(self, parts, mine: list[MicroBatch], input_ids: Tensor, positions: Tensor, step: int) -> Tensor:
        """2:1: each peer gets its sequences' step (control socket) and computes their layers while
        rank 0 computes its own; their last hidden rows come back over gloo, into batch order."""
        hidden = self.model.config.hidden_size
        out = torch.empty(len(input_ids), hidden, dtype=self.model.model.embed_tokens.weight.dtype)
        waiting = []
        for a, (part, rows) in enumerate(parts[1:], start=1):
            if not part.seqs:
                continue                        # an idle peer gets nothing: it waits for the next step
            msg = PeerStep(step, self.m, input_ids[rows].tolist(), positions[rows].tolist(),
                           [RemoteSeq(s.num_computed_tokens, list(s.block_table)) for s in part.seqs], part.num_tokens)
            self.conns[self.n_ffn + a - 1].send_bytes(pickle.dumps(msg))
            buf, src = torch.empty(len(rows), hidden, dtype=out.dtype), attention_rank(a, self.n_ffn)
            waiting.append((p2p.irecv(buf, src), buf, rows, src))
        if mine:
            rows = parts[0][1]
            out[rows] = self.layers(mine, input_ids[rows], positions[rows], step)
        for work, buf, rows, src in waiting:
            with self.timeline.span("wait peer", "recv", step=step, rank=src):
                p2p.wait(work, f"last hidden rows of step {step} from attention rank {src}", self.timeout_s)
            out[rows] = buf
            self.traffic.from_peers += buf.numel() * buf.element_size()
        return out

    def layers(self, mbs: list[MicroBatch], input_ids: Tensor, positions: Tensor, step: int) -> Tensor:
        """Embed, then every layer: attention halves here, FFN halves on the FFN ranks, micro-batches
        ping-ponging; returns the last layer's output rows (before the final norm)."""
        tl, model = self.timeline, self.model
        with tl.span("embed", "compute", step=step):
            cos, sin = model.rotary(positions)
            x = model.model.embed_tokens(input_ids)
        first = mbs[0].start
        xs = [x[mb.start - first:mb.end - first] for mb in mbs]
        rope = [(cos[mb.start - first:mb.end - first], sin[mb.start - first:mb.end - first]) for mb in mbs]
        attns = [FlashPagedAttention(self.pool, mb.batch, self.backend) for mb in mbs]
        pending: list[_Pending | None] = [None] * len(mbs)
        sends: deque = deque()                  # (work, tensor): a tensor must outlive its send
        for l, layer in enumerate(model.model.layers):
            for i, mb in enumerate(mbs):
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
        return torch.cat(xs) if len(xs) > 1 else xs[0]

    def _receive(self, p: _Pending, step: int, i: int) -> Tensor:
        """Wait for micro-batch i's FFN output; the span's round trip runs from its send's start."""
        with self.timeline.span("wait FFN", "recv", step=step, layer=p.layer, micro_batch=i) as args:
            p2p.wait(p.work, f"FFN output of step {step} layer {p.layer} micro-batch {i} from rank {p.dst}",
                     self.timeout_s)
            args["round_trip_us"] = (time.perf_counter_ns() - p.sent_ns) / 1e3
        return p.buf


@dataclass
class RemoteSeq:
    """What a peer's step attention reads of a sequence (lesson 15's FlashPagedAttention)."""
    num_computed_tokens: int
    block_table: list[int]


@dataclass
class PeerStep:
    """One step's work for a peer attention rank: its sequences' new tokens, positions and blocks."""
    step: int
    m: int
    input_ids: list[int]
    positions: list[int]
    seqs: list[RemoteSeq]
    num_tokens: list[int]

    def batch(self) -> ScheduledBatch:
        return ScheduledBatch(list(self.seqs), list(self.num_tokens))


def split_by_owner(batch: ScheduledBatch, n_attention: int) -> list[tuple[ScheduledBatch, Tensor]]:
    """The step's sequences per attention worker (`owner`), in batch order, with their rows."""
    parts = [(ScheduledBatch(), []) for _ in range(n_attention)]
    row = 0
    for seq, n in zip(batch.seqs, batch.num_tokens):
        part, rows = parts[owner(seq.seq_id, n_attention)]
        part.add(seq, n)
        rows.extend(range(row, row + n))
        row += n
    return [(part, torch.tensor(rows, dtype=torch.long)) for part, rows in parts]
