"""Lesson 17: tensor parallelism. The model split over several processes that talk through
torch.distributed (gloo on a CPU) and a shared-memory all-reduce.

1. how the model splits: heads, KV heads, MLP columns and vocabulary rows per rank, and the
   memory each rank holds, against one process;
2. eight chat requests through TP=1 and TP=N: same answers, time, what the ranks exchanged;
3. what goes wrong on purpose: a split that does not divide, and a worker killed mid-run.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch

from minivllm_support.cli import base_parser, identity_line, machine, setup
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from minivllm_support.models import chat_prompt_ids, load_tokenizer, resolve_model
from step04_transformer.config import ModelConfig
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel import parallel
from step17_tensor_parallel.engine import TPEngine, WorkerFailed
from step17_tensor_parallel.layers import vocab_range
from step17_tensor_parallel.model import check_tp_shapes, local_config

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain why the sky is blue in two sentences.", "What is 12 times 12?",
             "Name a famous painting and its painter.", "Give me a tip for learning Python.",
             "What does a compiler do?"]


def smallest_split(cfg: ModelConfig) -> int:
    for tp in range(2, 9):
        try:
            check_tp_shapes(cfg, tp)
            return tp
        except ValueError:
            pass
    raise SystemExit("this model does not split 2 to 8 ways")


def config(tp: int) -> PagedSchedulerConfig:
    """128 MiB of KV on each rank of TP=1; 128/tp on each rank of TP=tp: the same blocks on both."""
    return PagedSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=128 * 2**20 // tp)


def show_split(cfg: ModelConfig, tp: int) -> None:
    local = local_config(cfg, tp)
    print(f"split {tp} ways: each rank holds {local.num_heads} of {cfg.num_heads} query heads, "
          f"{local.num_kv_heads} of {cfg.num_kv_heads} KV heads"
          f"{' (replicated)' if cfg.num_kv_heads < tp else ''}, {local.intermediate_size} of "
          f"{cfg.intermediate_size} MLP columns, {vocab_range(cfg.vocab_size, 0, tp)[2]} of {cfg.vocab_size} "
          f"vocabulary rows")


def chat(folder, tok, tp: int, dtype: torch.dtype) -> None:
    prompts = [chat_prompt_ids(tok, q) for q in QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for n in (1, tp):
        t0 = time.perf_counter()
        with TPEngine(folder, config(n), tensor_parallel_size=n, dtype=dtype, use_graph=False) as engine:
            built = time.perf_counter() - t0
            if n == 1:
                print(f"TP=1: {torch.get_num_threads()} threads in one process")
            else:
                print(f"TP={n}: {n} processes, {torch.get_num_threads()} thread(s) each, all-reduce via "
                      f"{engine.all_reduce}")
            for r, m in enumerate(engine.rank_memory):
                print(f"  rank {r}: weights {m['weight_bytes'] / 2**20:6.1f} MiB, KV pool {m['kv_bytes'] / 2**20:5.1f} MiB "
                      f"({engine.kv_pool.num_blocks} blocks)")
            parallel.COMM.reset()
            t0 = time.perf_counter()
            outs[n] = [s.output_token_ids for s in engine.generate(prompts, sp)]
            secs = time.perf_counter() - t0
            c = parallel.COMM
            print(f"  built in {built:.1f} s; {sum(map(len, outs[n]))} tokens in {secs:.2f} s, {engine.num_steps} steps")
            if n > 1:
                print(f"  rank 0 made {c.calls / engine.num_steps:.0f} collectives a step, sent "
                      f"{c.bytes / engine.num_steps / 1024:.0f} KiB a step, spent {c.seconds:.2f} s in them "
                      f"({100 * c.seconds / secs:.0f}% of the time, waiting for the other ranks included)")
    a, b = outs[1], outs[tp]
    print(f"\n  Q: {QUESTIONS[0]}\n  A (TP={tp}): {tok.decode(b[0], skip_special_tokens=True).strip()!r}")
    same = sum(x == y for x, y in zip(a, b))
    print("  " + identity_line(f"answers of TP=1 and TP={tp}", same, len(a), dtype))
    if same < len(a) and dtype != torch.float32:
        print("  (and under TP each rank rounds its partial sum to bf16 before the all-reduce adds them: "
              "one rounding more than TP=1 makes)")


def faults(folder, cfg: ModelConfig, tp: int, dtype: torch.dtype) -> None:
    bad = next(n for n in range(2, 9) if n != tp and _fails(cfg, n))
    try:
        TPEngine(folder, tensor_parallel_size=bad)
    except ValueError as e:
        print(f"TPEngine(tensor_parallel_size={bad}) -> ValueError: {e}")
    engine = TPEngine(folder, config(tp), tensor_parallel_size=tp, dtype=dtype, use_graph=False)
    for _ in range(4):
        engine.add_request(list(range(100, 200)), SamplingParams(max_tokens=2000, ignore_eos=True))
    victim, killed_at = engine.workers[-1], []
    def kill() -> None:
        killed_at.append(time.perf_counter())
        os.kill(victim.pid, signal.SIGKILL)
    threading.Timer(1.0, kill).start()
    try:
        while True:
            engine.step()
    except WorkerFailed as e:
        print(f"worker pid {victim.pid} killed 1 s into a generation -> WorkerFailed "
              f"{time.perf_counter() - killed_at[0]:.2f} s after the kill, every process stopped:")
        print("  " + "\n  ".join(line for line in str(e).splitlines() if "rank" in line and "process" in line))
    alive = [p.pid for p in engine.workers if p.is_alive()]
    print(f"  processes still running afterwards: {alive or 'none'}")


def _fails(cfg: ModelConfig, n: int) -> bool:
    try:
        check_tp_shapes(cfg, n)
        return False
    except ValueError:
        return True


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--tp", type=int, default=None,
                   help="tensor_parallel_size (default: the smallest split the model allows: 3 for SmolLM2, 2 for Qwen3)")
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype = setup(args)
    folder = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(folder)
    tp = args.tp or smallest_split(cfg)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    show_split(cfg, tp)
    print()
    chat(folder, load_tokenizer(folder), tp, dtype)
    print()
    faults(folder, cfg, tp, dtype)


if __name__ == "__main__":
    main()
