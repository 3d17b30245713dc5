"""The process group and the two collectives tensor parallelism needs, timed.

Every rank holds a slice of every layer. After a row-parallel linear each rank has a partial
sum of the full output, so the ranks add their partials together (all-reduce, sum); after the
parallel LM head each rank has the logits of its part of the vocabulary, and rank 0, the one
that samples, collects them (gather). Nothing else is ever sent between ranks during a step.

gloo carries the collectives between CPU processes over TCP; NCCL does it between GPUs. The
calls are the same, only the backend name changes. On one CPU machine the all-reduces can go
through shared memory instead (shm_allreduce.py), ~15x faster here; gloo still carries the
rest (the rendezvous, the logits gather, all-reduces too big for the shared buffer).
"""
from __future__ import annotations

import datetime
import importlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommStats:
    """What this process spent in collectives: the README's "time in all-reduce" comes from here."""
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def reset(self) -> None:
        self.calls, self.seconds, self.bytes = 0, 0.0, 0


COMM = CommStats()
_shm = None     # a ShmAllReduce (shm_allreduce.py) when the ranks share memory for all-reduces
# The ranks an all-reduce spans: None is every rank (this lesson); a pipeline of tensor-parallel
# stages (advanced lesson 06) gives each stage its own group, vLLM's "TP group".
_tp_group = None


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def make_store(rank: int, world: int, port: int, timeout_s: float, host: str = "127.0.0.1",
               is_master: bool | None = None) -> dist.TCPStore:
    """The rendezvous store. Rank 0 hosts it (port 0: the OS picks a free one, read back from
    .port); the others dial host:port, retrying until timeout_s, so their start order does not
    matter. Under torchrun it already exists (torchrun's agent hosts it): everyone is a client."""
    master = rank == 0 if is_master is None else is_master
    return dist.TCPStore(host, port, world if master else None, is_master=master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _import_before_any_group() -> None:
    """torch.distributed._shard, which torch imports on the first computation on the meta device
    (our loaders build models there), keeps references to the process group that exists when it
    is imported. That group is then never freed: destroy_process_group leaves gloo's threads
    running, and at interpreter exit one of them may drop a finished collective's tensors
    without the GIL and abort the process (seen under torchrun: exit code -6 after a clean run,
    about once in 40). Imported while no group exists, it holds none."""
    try:
        importlib.import_module("torch.distributed._shard")
    except ImportError:
        pass


def init_group(store: dist.Store, rank: int, world: int, timeout_s: float, device_type: str = "cpu") -> None:
    """Join the default process group. `timeout_s` bounds every collective: a rank that stops
    answering turns into an error on the others after that long, never into a hang. The group's
    keys get their own prefix, so a store shared with others (torchrun's) is not disturbed."""
    _import_before_any_group()
    dist.init_process_group(backend_for(device_type), store=dist.PrefixStore("minivllm/pg", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def use_shared_memory(comm) -> None:
    """Route all-reduces that fit through `comm` (a ShmAllReduce); None: back to the process group."""
    global _shm
    if _shm is not None and comm is None:
        _shm.close()
    _shm = comm


def use_tp_group(group) -> None:
    """Make the layers' all-reduces span `group` (a dist.new_group) instead of every rank."""
    global _tp_group
    _tp_group = group


def close_group() -> None:
    use_shared_memory(None)
    use_tp_group(None)
    if dist.is_initialized():
        dist.destroy_process_group()


class CollectiveError(RuntimeError):
    """A collective failed: another rank died, raised, or did not answer within the timeout."""


def _collective(name: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - gloo/NCCL/shm raise RuntimeError or DistError
        raise CollectiveError(f"{name} failed: {e}") from e


def barrier() -> None:
    _collective("barrier", dist.barrier)


def all_reduce(x: Tensor) -> Tensor:
    """Sum `x` over all ranks, in place; every rank gets the same bits back."""
    t0 = time.perf_counter()
    if _shm is not None and _shm.fits(x):   # the same choice on every rank: x has the same size on all
        _collective("all-reduce (shared memory)", _shm, x)
    else:
        _collective("all-reduce", dist.all_reduce, x, group=_tp_group)
    COMM.seconds += time.perf_counter() - t0
    COMM.calls += 1
    COMM.bytes += x.numel() * x.element_size()
    return x


def gather_to_rank0(x: Tensor, world: int) -> list[Tensor] | None:
    """Every rank's `x` (same shape on all ranks) collected on rank 0; None elsewhere."""
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(world)] if dist.get_rank() == 0 else None
    _collective("gather", dist.gather, x, parts, dst=0)
    COMM.seconds += time.perf_counter() - t0
    COMM.calls += 1
    COMM.bytes += x.numel() * x.element_size()
    return parts
