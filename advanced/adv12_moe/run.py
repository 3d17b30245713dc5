"""Advanced lesson 12: a small Qwen3-MoE (random weights, built with transformers) through the
engine: throughput, tokens routed to each expert, balancedness per rank before and after EPLB
and how it drifts on another workload, and expert parallel over --ep processes against one."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minivllm_support.cli import DTYPES, identity_line, machine, resolve_dtype_name
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from advanced.adv12_moe.config import MoEConfig
from advanced.adv12_moe.ep import EP_COMM
from advanced.adv12_moe.ep_engine import EPEngine
from advanced.adv12_moe.eplb import Placement, balancedness, rebalance_experts, static_placement
from advanced.adv12_moe.model import routing_counts
from advanced.adv12_moe.tiny import build_tiny_moe


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="a Qwen3-MoE checkpoint folder (default: a small one with random "
                   "weights, built with transformers into --out)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="bf16 / fp32 (auto: what the CPU "
                   "computes natively)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each engine after one warm-up")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel processes")
    p.add_argument("--spare-slots", type=int, default=2, help="physical expert slots per rank beyond E / ep: "
                   "room for EPLB's replicas")
    p.add_argument("--skew", type=float, default=0.5, help="std of the random bias added to every router's logits "
                   "(0: the model's own routing)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", default="build/adv12", help="where the default model is built")
    add_launch_flags(p, "python -m advanced.adv12_moe.node")
    return p.parse_args()


def small_moe(out: Path) -> Path:
    """16 experts, 4 per token, 4 sparse layers, hidden 256: 15 M parameters, random (seed 0)."""
    folder = out / "small-moe"
    if not (folder / "config.json").is_file():
        build_tiny_moe(folder, vocab_size=4096, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16,
                       num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024)
    return folder


def workload(vocab: int, half: int, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids from one half of the vocabulary (0: lower, 1: upper)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (3, vocab // 2) if half == 0 else (vocab // 2, vocab)
    return [torch.randint(lo, hi, (length,), generator=g).tolist() for _ in range(n)]


def timed(engine: EPEngine, prompts, sp, repeats: int) -> tuple[list[tuple[float, float]], int, list[list[int]]]:
    """([(seconds, seconds in EP collectives) of each timed run], engine steps of one run, outputs);
    one untimed warm-up first."""
    engine.generate(prompts, sp)
    runs, outputs, steps = [], None, 0
    for _ in range(repeats):
        before, comm = engine.num_steps, EP_COMM.seconds
        t0 = time.perf_counter()
        outputs = [s.output_token_ids for s in engine.generate(prompts, sp)]
        runs.append((time.perf_counter() - t0, EP_COMM.seconds - comm))
        steps = engine.num_steps - before
    return runs, steps, outputs


def time_row(name: str, runs: list[tuple[float, float]], steps: int, collectives: bool) -> str:
    """The fastest run's ms per step, and its ms per step in the collectives."""
    wall, comm = min(runs)
    a2a = f"{1e3 * comm / steps:19.1f}" if collectives else f"{'-':>19}"
    return f"  {name:<28} {' '.join(f'{w:.2f}' for w, _ in runs):<22} {1e3 * wall / steps:8.1f} {a2a}"


def loads_line(name: str, placements: dict[int, Placement], counts: torch.Tensor, layers: list[int]) -> str:
    per_layer = [balancedness(placements[layer].rank_loads(counts[i])) for i, layer in enumerate(layers)]
    mean = sum(per_layer) / len(per_layer)
    return f"  {name:<44} " + " ".join(f"{b:6.3f}" for b in per_layer) + f"   mean {mean:.3f}"


def main() -> None:
    args = parse()
    if args.ep < 2 or args.spare_slots < 0:
        raise SystemExit(f"--ep must be >= 2 (got {args.ep}) and --spare-slots >= 0 (got {args.spare_slots})")
    torch.set_grad_enabled(False)
    dtype = DTYPES[resolve_dtype_name(args.dtype)]
    folder = Path(args.model) if args.model else small_moe(Path(args.out))
    cfg = MoEConfig.from_pretrained(folder)
    layers, E, R = cfg.sparse_layers, cfg.num_experts, args.ep
    bias = torch.randn(len(layers), E, generator=torch.Generator().manual_seed(7)) * args.skew if args.skew else None
    print(f"machine: {machine()}")
    weights = "random weights, " if not args.model else ""
    print(f"model: {folder} ({weights}{resolve_dtype_name(args.dtype)}): {cfg.num_layers} layers, "
          f"sparse {layers}, {E} experts, {cfg.num_experts_per_tok} per token, expert inner size "
          f"{cfg.moe_intermediate_size}; router skew: N(0, {args.skew}) bias on the logits (seed 7)")
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sets = {name: workload(cfg.vocab_size, half, args.requests, args.prompt_len, 1 + half)
            for half, name in enumerate(("A", "B"))}
    print(f"workloads: {args.requests} prompts of {args.prompt_len} random token ids, {args.max_tokens} greedy "
          f"tokens each; A from the lower half of the vocabulary, B from the upper half\n")
    sched = PagedSchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=256, kv_cache_bytes=64 << 20)

    # 1. one process: throughput and routing counts on both workloads
    counts = {}
    with EPEngine(folder, sched, expert_parallel_size=1, dtype=dtype, router_bias=bias) as one:
        for name, prompts in sets.items():
            before = routing_counts(one.model)
            t0 = time.perf_counter()
            one.generate(prompts, sp)
            wall = time.perf_counter() - t0
            counts[name] = routing_counts(one.model) - before
            print(f"one process, workload {name}: {args.requests * args.max_tokens / wall:.0f} generated tok/s "
                  f"({wall:.2f} s, first run)")
        one_time, one_steps, ref = timed(one, sets["A"], sp, args.repeats)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)                 # what each expert-parallel rank gets on 2 cores
        one_thread_time, _, _ = timed(one, sets["A"], sp, args.repeats)
        torch.set_num_threads(threads)
    print("\ntokens routed to each expert (workload A, every (token, slot) pair of prompts and decodes):")
    for i, layer in enumerate(layers):
        print(f"  layer {layer}: " + " ".join(f"{int(c):5d}" for c in counts["A"][i]))

    # 2. EPLB on the counts: placements for R ranks, balancedness (mean / max load per rank) per layer
    slots = E + R * args.spare_slots
    static = {layer: static_placement(E, R) for layer in layers}
    eplb = {name: {layer: rebalance_experts(c[i], slots, R) for i, layer in enumerate(layers)}
            for name, c in counts.items()}
    print(f"\nbalancedness over {R} ranks (mean / max tokens per rank; 1.0 = even), per sparse layer, from the "
          f"counts above:")
    print(loads_line("A: static (E/R experts per rank, in order)", static, counts["A"], layers))
    print(loads_line(f"A: EPLB fitted on A ({slots} slots)", eplb["A"], counts["A"], layers))
    print(loads_line("B: static", static, counts["B"], layers))
    print(loads_line("B: EPLB fitted on A (the workload changed)", eplb["A"], counts["B"], layers))
    print(loads_line("B: EPLB fitted on B (rebalanced)", eplb["B"], counts["B"], layers))
    replicas = [int(c) for c in eplb["A"][layers[0]].replica_counts]
    print(f"  layer {layers[0]}, EPLB on A: replicas per expert {replicas}")

    # 3. expert parallel: R processes against one, static and EPLB placements
    print(f"\nexpert parallel, workload A ({args.repeats} timed runs after a warm-up; one engine at a time):")
    print(f"  {'engine':<28} {'wall s (runs)':<22} {'ms/step':>8} {'all-to-all ms/step':>19}  measured balancedness")
    for name, runs in ((f"one process, {threads} threads", one_time), ("one process, 1 thread", one_thread_time)):
        print(time_row(name, runs, one_steps, False) + "  -")
    same = total = 0
    launch = launch_from_args(args)
    variants = [("static", static), ("EPLB (fitted on A)", eplb["A"])]
    if launch.multi_node:       # a headless node serves one engine, then exits: run the EPLB one only
        variants = variants[1:]
    for name, placements in variants:
        with EPEngine(folder, sched, expert_parallel_size=R, placements=placements, dtype=dtype,
                      router_bias=bias, launch=launch) as ep:
            path = next(m.expert_path for m in ep.model.modules() if hasattr(m, "expert_path"))
            runs, steps, outputs = timed(ep, sets["A"], sp, args.repeats)
            measured = [balancedness(r) for r in path.rows_per_rank.values()]
        same += sum(o == r for o, r in zip(outputs, ref))
        total += len(ref)
        print(time_row(f"EP={R}, {name}", runs, steps, True) + "  " + " ".join(f"{b:.3f}" for b in measured))
    print("  (ms/step: the fastest run's wall time over its engine steps; all-to-all: rank 0's time in that run's\n"
          "   dispatch, combine and all-gather collectives; measured balancedness: from the rows each rank's experts\n"
          "   computed in the warm-up and the timed runs, per layer)")
    print(identity_line(f"outputs, EP={R} vs one process", same, total, dtype))


if __name__ == "__main__":
    main()
