"""Lesson 15's and this lesson's Triton kernels on a CUDA GPU, one attention layer, against torch's SDPA.

    TRITON_INTERPRET=0 python advanced/adv04_flash_decoding/bench_gpu.py      # needs a GPU; ~15 s on an H200

The Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16)
in a shuffled paged pool (reference.py's random_paged_case): a decode batch of 64 sequences of
1000 keys, one decode at 32k keys (where splitting the keys matters) and a prompt batch of
4 x 1024 tokens. SDPA gets the same K/V already gathered into dense [B, H, L, D] tensors (the
gather is not timed), so it shows what the paged kernels cost next to torch's best kernel.

Two times per variant: "call" is CUDA events around back-to-back calls, and includes what the
Python wrappers do on the host (the Triton wrappers read lengths back to the CPU every call);
"GPU" is the kernels' own time from torch.profiler. GB/s = K/V bytes of every key / GPU time
(the measure for decodes; prompts are bound by their products instead).
"""
from __future__ import annotations

import datetime
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from advanced.adv04_flash_decoding.splits import choose_split_size, splits_per_sequence
from advanced.adv04_flash_decoding.triton_decode import flash_decode_triton
from step15_flash_attention.reference import gather_kv, random_paged_case, reference_attention
from step15_flash_attention.triton_attention import flash_attention_triton

HQ, HKV, D, BS = 16, 8, 128, 16
CALLS, REPEATS = 20, 5


def time_call(fn: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """(median ms a call from CUDA events, GPU ms a call from the profiler); the first call compiles."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / CALLS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()                           # kernels and copies; self time: none counted twice
    gpu_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) for e in events)
    return statistics.median(runs), gpu_us / 1e3 / CALLS


def dense_sdpa(case: tuple, causal: bool) -> Callable[[], torch.Tensor]:
    """SDPA over K/V gathered once into [B, Hkv, L, D] (equal lengths), GQA by enable_gqa."""
    q, k_pool, v_pool, cu, lens, tables = case
    B, L = len(lens), int(lens[0])
    k = torch.stack([gather_kv(k_pool, tables[b], L) for b in range(B)]).transpose(1, 2).contiguous()
    v = torch.stack([gather_kv(v_pool, tables[b], L) for b in range(B)]).transpose(1, 2).contiguous()
    qd = q.view(B, -1, HQ, D).transpose(1, 2)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def go(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qd, k, v, is_causal=causal, enable_gqa=True)
        try:
            go()
            go.name = f"torch SDPA ({backend.name.lower()}, dense K/V)"
            return go
        except RuntimeError:
            continue
    raise RuntimeError("no fused SDPA backend takes this shape")


def report(title: str, q_lens: list[int], seq_lens: list[int], variants: dict[str, Callable]) -> None:
    case_cpu = random_paged_case(q_lens, seq_lens, HKV, HQ // HKV, BS, D, torch.bfloat16, seed=len(seq_lens))
    ref = reference_attention(*case_cpu)
    case = tuple(t.cuda() for t in case_cpu)
    kv_bytes = 2 * sum(seq_lens) * HKV * D * 2
    print(f"\n== {title}: K/V {kv_bytes / 1e6:.0f} MB")
    print(f"  {'variant':<58} {'call ms':>8} {'GPU ms':>8} {'GB/s':>7}  max |out - fp32 reference|")
    fns = {name: make(case) for name, make in variants.items()}
    if len(set(seq_lens)) == 1 and (max(q_lens) == 1 or q_lens == seq_lens):   # decodes, or whole prompts
        sdpa = dense_sdpa(case, causal=max(q_lens) > 1)
        fns[sdpa.name] = sdpa
    for name, fn in fns.items():
        try:                                               # one variant that fails to compile: say so, go on
            out = fn()
            call_ms, gpu_ms = time_call(fn)
        except Exception as e:
            print(f"  {name:<58} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        if out.dim() == 4:                                 # SDPA: [B, H, n, D] back to [T, H, D]
            out = out.transpose(1, 2).flatten(0, 1)
        err = (out.float().cpu() - ref).abs().max().item()
        print(f"  {name:<58} {call_ms:8.3f} {gpu_ms:8.3f} {kv_bytes / gpu_ms / 1e6:7.0f}  {err:.1e}")


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"GPU: {props.name}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today().isoformat()}")
    src = torch.ones(2**29, dtype=torch.bfloat16, device="cuda")      # 1 GiB, far past the L2
    dst = torch.empty_like(src)
    _, copy_ms = time_call(lambda: dst.copy_(src))
    print(f"device-to-device copy of 1 GiB: {2 * src.nbytes / copy_ms / 1e6:.0f} GB/s (bytes read + written)")
    del src, dst
    lesson15 = {f"lesson 15 flash_attention_triton, key tiles of {n}":
                (lambda c, n=n: lambda: flash_attention_triton(*c, check=False, block_n=n)) for n in (16, 64)}
    for batch, context in ((64, 1000), (1, 32768)):
        split = choose_split_size([context] * batch, HQ, sms, BS)
        n = splits_per_sequence([context], split)[0]
        variants = dict(lesson15)
        for bn in (16, 64):
            variants[f"adv04 flash_decode_triton, rule: {n} split(s) of {split}, tiles {bn}"] = \
                lambda c, s=split, bn=bn: lambda: flash_decode_triton(*c, split_size=s, check=False, block_n=bn)
        if n == 1:
            variants["adv04 flash_decode_triton, 4 splits of 256"] = \
                lambda c: lambda: flash_decode_triton(*c, split_size=256, check=False)
        report(f"decode, batch {batch}, {context} keys each", [1] * batch, [context] * batch, variants)
    prefill = {f"lesson 15 flash_attention_triton, tiles {m}x{n}":
               (lambda c, m=m, n=n: lambda: flash_attention_triton(*c, check=False, block_m=m, block_n=n))
               for m, n in ((16, 16), (64, 32), (128, 64))}
    report("prompts, 4 x 1024 tokens, causal", [1024] * 4, [1024] * 4, prefill)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
