"""Lesson 03: hand-written attention vs PyTorch's fused kernel, RoPE, and what GQA saves."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from minivllm_support.cli import base_parser, machine, setup
from step03_attention.attention import apply_rope, attention, causal_mask, rope_cos_sin, rope_inv_freq


def main() -> None:
    args = base_parser(__doc__).parse_args()
    setup(args)
    print(f"machine: {machine()}\n")
    torch.manual_seed(0)

    print("causal mask for 3 new queries over 5 keys (1 = may attend):")
    print(causal_mask(3, 5).int())

    # Qwen3-0.6B's attention shape: 16 query heads share 8 key/value heads of 128 dims.
    B, Hq, Hkv, L, D = 1, 16, 8, 256, 128
    q, k, v = (torch.randn(B, h, L, D) for h in (Hq, Hkv, Hkv))
    ours = attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    print(f"\nours vs torch SDPA (causal, GQA {Hq}q/{Hkv}kv, L={L}, fp32): "
          f"max |diff| = {(ours - ref).abs().max().item():.2e}")

    def clock(fn, n=5):
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    t_ours = clock(lambda: attention(q, k, v))
    t_ref = clock(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    print(f"time: ours {t_ours:.2f} ms (materialises the {L}x{L} score matrix per head), "
          f"torch SDPA {t_ref:.2f} ms")

    kv_bytes = lambda heads: 2 * heads * D * 2  # K and V, bf16
    print(f"\nKV cache per token per layer in bf16: MHA ({Hq} heads) {kv_bytes(Hq)} B, "
          f"GQA ({Hkv} heads) {kv_bytes(Hkv)} B -> GQA stores {Hq // Hkv}x less")

    # RoPE makes q.k depend only on the distance between positions.
    inv = rope_inv_freq(D, theta=1_000_000.0)
    qv, kv_ = torch.randn(D), torch.randn(D)
    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor(pq), inv)
        ck, sk = rope_cos_sin(torch.tensor(pk), inv)
        return float(apply_rope(qv, cq, sq) @ apply_rope(kv_, ck, sk))
    print("\nRoPE: q.k for query/key positions with the same distance 7:")
    for pq in (7, 100, 5000):
        print(f"  positions ({pq:>4}, {pq - 7:>4}) -> {score(pq, pq - 7):+.5f}")
    print(f"  a different distance (100, 50) -> {score(100, 50):+.5f}")


if __name__ == "__main__":
    main()
