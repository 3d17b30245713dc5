"""The attention backends lesson 15 offers, and the one choice the engine makes among them.

Every backend runs the same kernel contract (reference.py): varlen queries, paged K/V read in
place through block tables, causal with prior context. They differ in where they run, the
pool layout they read and the block sizes they accept:

    name         runs on                  pool layout                        block size
    torch        anywhere (slow, to read)  head-major [blocks, Hkv, bs, D]   any
    cpu          CPU, C++ kernel           head-major                        any (<= 1024)
    triton       CUDA (CPU: interpreter)   head-major                        any
    flash-attn   CUDA, flash-attn 2        token-major [blocks, bs, Hkv, D]  multiple of 256

"auto" takes the first that can run on the model's device: flash-attn, triton, torch on CUDA;
cpu, torch on a CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from step12_paged_attention.kv_pool import KVPool
from step14_batched_forward.kv_pool import HeadMajorKVPool

Kernel = Callable[..., Tensor]   # (q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, check) -> out


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    kernel: Kernel
    pool_class: type
    block_size_multiple: int = 1


def _torch_kernel(q, k_pool, v_pool, cu, lens, tables, check: bool = True) -> Tensor:
    from step15_flash_attention.flash_cpu import check_inputs
    from step15_flash_attention.flash_torch import flash_attention_torch
    if check:
        check_inputs(q, k_pool, v_pool, cu, lens, tables, {torch.float32, torch.bfloat16, torch.float16})
    return flash_attention_torch(q, k_pool, v_pool, cu, lens, tables)


def _cpu_kernel(q, k_pool, v_pool, cu, lens, tables, check: bool = True) -> Tensor:
    from step15_flash_attention.flash_cpu import flash_attention_cpu
    return flash_attention_cpu(q, k_pool, v_pool, cu, lens, tables, check=check)


def _triton_kernel(q, k_pool, v_pool, cu, lens, tables, check: bool = True) -> Tensor:
    from step15_flash_attention.triton_attention import flash_attention_triton
    return flash_attention_triton(q, k_pool, v_pool, cu, lens, tables, check=check)


def _flash_attn_kernel(q, k_pool, v_pool, cu, lens, tables, check: bool = True) -> Tensor:
    from step15_flash_attention.flash_attn_backend import flash_attn_paged
    return flash_attn_paged(q, k_pool, v_pool, cu, lens, tables, check=check)


def _cpu_available(device: torch.device) -> bool:
    from step15_flash_attention import flash_cpu
    return device.type == "cpu" and flash_cpu.load() is not None


def _triton_available(device: torch.device) -> bool:
    try:
        from step15_flash_attention.triton_attention import triton_available
    except ImportError:
        return False
    if device.type == "cpu":     # only in the interpreter: right, but far too slow to pick by default
        return os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
    return device.type == "cuda" and triton_available()


def _flash_attn_available(device: torch.device) -> bool:
    from step15_flash_attention.flash_attn_backend import flash_attn_available
    return device.type == "cuda" and flash_attn_available()


BACKENDS: dict[str, tuple[AttentionBackend, Callable[[torch.device], bool]]] = {
    "torch": (AttentionBackend("torch", _torch_kernel, HeadMajorKVPool), lambda device: True),
    "cpu": (AttentionBackend("cpu", _cpu_kernel, HeadMajorKVPool), _cpu_available),
    "triton": (AttentionBackend("triton", _triton_kernel, HeadMajorKVPool), _triton_available),
    "flash-attn": (AttentionBackend("flash-attn", _flash_attn_kernel, KVPool, block_size_multiple=256),
                   _flash_attn_available),
}
AUTO_ORDER = {"cuda": ["flash-attn", "triton", "torch"], "cpu": ["cpu", "torch"]}


def choose_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`, or for "auto" the best one that runs on `device`."""
    device = torch.device(device)
    if name == "auto":
        for candidate in AUTO_ORDER.get(device.type, ["torch"]):
            backend, available = BACKENDS[candidate]
            if available(device):
                return backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}: choose 'auto' or one of {sorted(BACKENDS)}")
    backend, available = BACKENDS[name]
    if not available(device):
        raise ValueError(f"attention_backend {name!r} cannot run on {device} here "
                         f"(available: {[n for n, (_, ok) in BACKENDS.items() if ok(device)]})")
    return backend
