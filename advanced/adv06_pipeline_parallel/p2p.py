"""What travels between the ranks of a pipeline, and how.

    rank 0 --control socket--> every worker: one step message per micro-batch (header + lesson
                               18's StepMetadata); the same connection lesson 17's workers use
    stage s --gloo isend/irecv--> stage s+1: the hidden states [T, hidden] of that micro-batch
    last stage --gloo isend--> rank 0: the final-normed hidden states [N, hidden] of the rows rank 0
                               will sample (it runs the LM head on them: N x hidden bytes, not N x vocab)

Tensor parallelism (lesson 17) needs collectives: every rank takes part in every all-reduce.
A pipeline only needs point-to-point messages between neighbours, and `isend`/`irecv` return
at once, so a stage can hand its output on and start on the next micro-batch while the bytes
travel. Messages between two ranks arrive in the order they were sent, so no tags are needed:
every stage handles micro-batches in the order rank 0 launched them.

A receive waits at most `timeout_s`: a stage that hangs upstream becomes an error downstream
(gloo's own error names the time-out); one that dies closes its sockets, and the receive fails
at once.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from step17_tensor_parallel.metadata import StepMetadata
from step17_tensor_parallel.parallel import CollectiveError

TIMELINE_REQUEST = b"timeline"      # rank 0 asks a worker for its spans (it answers over the control socket)


def control_messages(conn, timeline):
    """A worker's side of the control channel: yields (when it began waiting, in ns; the
    message's bytes) for every step message, answers a timeline request on the way, and
    returns when rank 0 sends the empty message that closes the engine."""
    while True:
        t0 = time.perf_counter_ns()
        data = conn.recv_bytes()
        if not data:
            return
        if data == TIMELINE_REQUEST:
            conn.send(("timeline", timeline.to_dict()))
            timeline.clear()
            continue
        yield t0, data


@dataclass
class StepHeader:
    step: int              # the engine's launch counter: the same number on every rank's spans
    micro_batch: int       # which virtual engine launched it
    decode_tokens: int     # of the step's tokens, how many are decodes (the rest: prompt chunks)


def pack_step(header: StepHeader, meta: StepMetadata) -> bytes:
    head = torch.tensor([header.step, header.micro_batch, header.decode_tokens], dtype=torch.long)
    return head.numpy().tobytes() + meta.to_bytes()


def unpack_step(data: bytes) -> tuple[StepHeader, StepMetadata]:
    n = 3 * 8
    head = torch.frombuffer(bytearray(data[:n]), dtype=torch.long).tolist()
    return StepHeader(*head), StepMetadata.from_bytes(data[n:])


def isend(tensor: Tensor, dst: int) -> dist.Work:
    """Start sending; keep `tensor` alive until the returned work is done."""
    try:
        return dist.isend(tensor.contiguous(), dst)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on a closed pair
        raise CollectiveError(f"send to rank {dst} failed: {e}") from e


def irecv(buf: Tensor, src: int) -> dist.Work:
    try:
        return dist.irecv(buf, src)
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"receive from rank {src} failed: {e}") from e


def wait(work: dist.Work, what: str, timeout_s: float) -> None:
    """Wait for a send or receive, at most `timeout_s`; any failure is a CollectiveError."""
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"{what} failed: {e}") from e
