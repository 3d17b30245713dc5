"""Lesson 16 on a GPU: the engines' tokens on CUDA, then decode-step latency eager vs CUDA graph.

    python step16_cuda_graph/bench.py [--batches 1 8 64] [--context 360]

1. tokens: the tiny random Qwen3 in float32, a few requests with chunked prompts, greedy:
   lesson 15's engine on the CPU (torch backend) against lesson 15's eager engine on CUDA
   (Triton kernel) and lesson 16's engine on CUDA (decode steps replayed as CUDA graphs);
   then the Qwen3-0.6B shape (random weights, bf16): eager vs graph on CUDA.
2. latency: one decode step (engine.step, everything included) of the Qwen3-0.6B shape, bf16,
   at each batch size, eager (lesson 16's build_engine with use_graph=False: lesson 15's
   engine, Triton) vs graph (lesson 16), as lesson 16's fast-path `bench.py step` does on a CPU; then the
   forward alone on the runner's static buffers, eager (`runner.decode`) vs one graph replay.
3. --profile B: the GPU kernels of one bucket-B forward, eager and replayed (torch.profiler).
The step-timing helpers (fill, step_turns, make_engine) are in decode_timing.py.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from minivllm_support.tiny import build_tiny_qwen3
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step12_paged_attention.kv_pool import KVPool
from step12_paged_attention.scheduler import PagedSchedulerConfig
from minivllm_support.workloads import random_qwen3_06b
from step16_cuda_graph.decode_timing import fill, make_engine, step_turns
from step15_flash_attention import engine as lesson15
from step16_cuda_graph.engine import build_engine

EAGER = (build_engine, {"attention_backend": "triton", "use_graph": False})     # lesson 15's engine
GRAPH = (build_engine, {"attention_backend": "triton"})


def generate(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
    return f"{same}/{len(a)} requests identical" + ("" if same == len(a) else f" (first difference at {first})")


def check_tokens() -> None:
    # Wider random weights than the tests' (0.02): greedy tokens then vary instead of repeating one.
    model = load_model(build_tiny_qwen3(tempfile.mkdtemp(), initializer_range=0.3), torch.float32)
    rng = random.Random(1)
    prompts = [[rng.randrange(5, model.config.vocab_size) for _ in range(n)] for n in (5, 17, 30, 9, 40, 3)]
    config = PagedSchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                  kv_cache_bytes=80 * KVPool.bytes_per_block(model.config, 4, torch.float32))
    # Unpacked on the CPU: oneDNN's packed float32 sums in another order than the GPU's matmuls.
    cpu = generate(lesson15.build_engine(model, config, attention_backend="torch", pack_weights=False), prompts, 16)
    model = model.to("cuda")
    eager = generate(build_engine(model, config, **EAGER[1]), prompts, 16)
    graph_engine = build_engine(model, config, **GRAPH[1])
    graph = generate(graph_engine, prompts, 16)
    print(f"tiny Qwen3 fp32, 6 requests x 16 tokens: CUDA eager (triton) vs CPU: {agree(eager, cpu)}; "
          f"CUDA graph vs CPU: {agree(graph, cpu)}; graph replays per bucket {dict(graph_engine.runner.replays)}")
    print(f"  e.g. CPU {cpu[1]}\n       GPU {graph[1]}")


def check_tokens_bf16(model) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 150000) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    outs = [generate(make_engine(model, build, options, kv_gib=1.0)[0], prompts, 32)
            for build, options in (EAGER, GRAPH)]
    print(f"Qwen3-0.6B shape (random) bf16, 8 requests x 32 tokens, CUDA graph vs CUDA eager: {agree(*outs)}")


@torch.inference_mode()
def forward_ms(runner, b: int, iters: int = 50) -> tuple[float, float]:
    """GPU-synchronised milliseconds of one bucket-b forward: eager on the static buffers, and replayed."""
    graph, _ = runner.graphs[b]
    results = []
    for fn in (lambda: runner.decode(b), graph.replay):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - t0) / iters * 1e3)
    return results[0], results[1]


def bench(model, batches: list[int], context: int, rounds: int) -> None:
    engine, secs = make_engine(model, *GRAPH, kv_gib=2.5)
    print(f"lesson 16's engine built in {secs:.1f} s, recording {len(engine.runner.buckets)} buckets "
          f"{engine.runner.record_seconds:.1f} s (mode {engine.runner.mode})")
    del engine
    print(f"one decode step (engine.step), context ~{context}, max_num_seqs=64, best of {rounds} alternating rounds")
    print(f"{'batch':>5} {'eager (lesson 15)':>18} {'graph (lesson 16)':>18} {'ratio':>6}"
          f"   forward only: {'eager':>8} {'replay':>8}")
    for b in batches:
        engines = {name: make_engine(model, build, options, kv_gib=2.5)[0]
                   for name, (build, options) in (("eager", EAGER), ("graph", GRAPH))}
        best = step_turns(engines, b, context, max(8, 64 // b), rounds)
        runner = engines["graph"].runner
        fwd = forward_ms(runner, next(x for x in runner.buckets if x >= b))
        print(f"{b:5d} {best['eager']:15.2f} ms {best['graph']:15.2f} ms {best['eager'] / best['graph']:5.2f}x"
              f"   {fwd[0]:14.2f} ms {fwd[1]:5.2f} ms")
        del engines, runner
        torch.cuda.empty_cache()


@torch.inference_mode()
def profile(model, b: int, context: int, top: int = 8) -> None:
    """Where one bucket-b forward spends GPU time: its kernels by total time, eager and replayed."""
    from torch.profiler import ProfilerActivity
    engine = make_engine(model, *GRAPH, kv_gib=1.0)[0]
    fill(engine, b, context, 16)
    runner = engine.runner
    graph, _ = runner.graphs[b]
    for name, fn in (("eager", lambda: runner.decode(b)), ("replay", graph.replay)):
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        # Eager, torch's ops (aten::mm, ...) are listed too, with their kernels' time: its sum
        # counts those kernels twice. A replay has no ops on the host: its list is kernels only.
        kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        gpu = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"bucket {b}, {name}: {wall * 1e3:.2f} ms wall (profiled), {gpu:.2f} ms of kernels, "
              f"{sum(e.count for e in kernels)} kernel runs; the largest:")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"    {e.self_device_time_total / 1e3:7.3f} ms  {e.count:5d}x  {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=360)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="B", help="profile these buckets only")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    model = load_model(random_qwen3_06b(), torch.bfloat16).to("cuda")
    if args.profile:
        for b in args.profile:
            profile(model, b, args.context)
        return
    check_tokens()
    check_tokens_bf16(model)
    bench(model, args.batches, args.context, args.rounds)


if __name__ == "__main__":
    main()
