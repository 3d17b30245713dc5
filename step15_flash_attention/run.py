"""Lesson 15: FlashAttention. Tiled online softmax in torch and in a C++ kernel, checked against
plain float32 attention, then a long real prompt through lesson 14's engine and lesson 15's.

1. the backend the engine picks here, and every backend that can run here;
2. the torch tiled algorithm and the C++ kernel against float32 attention, on a mixed batch at
   the model's own head shape (decodes, a whole prompt, a chunk with prior context);
3. a long prompt (lesson 13's README, about 4,500 tokens, plus a question), chunked at 512
   tokens a step: lesson 14 (gather + SDPA with a mask) vs lesson 15 (one kernel call a layer),
   after a short warm-up, twice each, taking turns;
4. one layer's attention over that prompt: our kernel vs torch's CPU flash SDPA, taking turns.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import Timing, compare, format_ratio
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.engine import BatchedEngine
from step15_flash_attention.backends import BACKENDS, choose_backend
from step15_flash_attention.engine import build_engine
from step15_flash_attention.flash_cpu import flash_attention_cpu, load
from step15_flash_attention.flash_torch import flash_attention_torch
from step15_flash_attention.reference import random_paged_case, reference_attention

DOCUMENT = Path(__file__).resolve().parent.parent / "step13_prefix_cache" / "README.md"


def check_kernels(cfg, dtype) -> None:
    group = cfg.num_heads // cfg.num_kv_heads
    case = random_paged_case([1, 1, 300, 64], [1, 700, 300, 900], cfg.num_kv_heads, group, 16, cfg.head_dim, dtype)
    ref = reference_attention(*case)
    kernels = [("torch tiled", flash_attention_torch)] + ([("C++ kernel", flash_attention_cpu)] if load() else [])
    print(f"1 decode of 1 key, 1 decode of 700 keys, a 300-token prompt, a 64-token chunk after 836 keys "
          f"({cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, {dtype}):")
    for name, fn in kernels:
        print(f"  {name:12s} max |out - float32 reference| = {(fn(*case).float() - ref).abs().max().item():.2e}")


def serve_long(engine: BatchedEngine, prompt: list[int], sp: SamplingParams) -> dict:
    """One long request alone: its prefill steps timed apart from the decode steps after them."""
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, sp)
    while engine.prompt_tokens < len(prompt):          # the prefill steps
        engine.step()
    t_prefill = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return {"outputs": seq.output_token_ids, "prefill": t_prefill, "decode": time.perf_counter() - t0 - t_prefill}


def long_prompt(model, tok, dtype, repeats: int = 2) -> int:
    question = "In one sentence: what does this lesson add to the engine?"
    prompt = chat_prompt_ids(tok, DOCUMENT.read_text() + "\n\n" + question)
    sp = SamplingParams(temperature=0, max_tokens=48)
    config = PagedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20)
    print(f"\nprompt: {DOCUMENT.parent.name}/README.md + a question = {len(prompt)} tokens, chunked at 512 a step")
    engines = {"lesson 14 (gather + SDPA)": BatchedEngine, "lesson 15 (flash kernel) ": build_engine}
    # Warm-up, not timed: the first 1024 tokens through each engine (oneDNN and the kernels meet
    # their shapes for the first time). A full untimed round (~30 s) would take the script past
    # two minutes, so each engine serves the prompt twice. A fresh engine each run (each build
    # packs its own copy of the weights): no prefix-cache hits.
    for build in engines.values():        # lesson 14's engine class, lesson 15's build_engine: (model, config)
        serve_long(build(model, config), prompt[:1024], SamplingParams(temperature=0, max_tokens=4))
    runs = compare({name: lambda build=build: serve_long(build(model, config), prompt, sp)
                    for name, build in engines.items()},
                   repeats=repeats, warmup=False)
    prefill = {}
    for name, timing in runs.items():
        prefill[name] = Timing(name, [r["prefill"] for r in timing.results])
        decode = Timing(name, [r["decode"] for r in timing.results])
        print(f"  {name}: prefill {prefill[name].describe()}, {len(prompt) / prefill[name].median:6.1f} tok/s, "
              f"then {len(timing.result['outputs'])} tokens in {decode.median:5.2f} s")
    print(f"  lesson 15 prefill {format_ratio(*prefill.values())}")
    a, b = (timing.result["outputs"] for timing in runs.values())
    print(f"  answer: {tok.decode(b, skip_special_tokens=True).strip()!r}")
    print("  " + identity_line("answers of lesson 14 and lesson 15", int(a == b), 1, dtype))
    return len(prompt)


def attention_alone(cfg, dtype, length: int, repeats: int = 5) -> None:
    Hq, Hkv, D, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    case = random_paged_case([length], [length], Hkv, Hq // Hkv, bs, D, dtype)
    q, k_pool, v_pool, cu, lens, tables = case
    k = k_pool[tables[0]].transpose(1, 2).flatten(0, 1)[:length].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
    v = v_pool[tables[0]].transpose(1, 2).flatten(0, 1)[:length].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
    k, v, qh = k.contiguous()[None], v.contiguous()[None], q.transpose(0, 1).contiguous()[None]
    print(f"\none layer's attention, one causal sequence of {length} tokens ({dtype}; taking turns, median of {repeats}):")
    runs = compare({"C++ kernel (paged, in place)": lambda: flash_attention_cpu(*case),
                    "torch SDPA is_causal (contiguous K/V)":
                        lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=True)}, repeats=repeats)
    for name, timing in runs.items():
        print(f"  {name:38s} {timing.median * 1e3:7.1f} ms ({timing.best * 1e3:.1f}-{max(timing.seconds) * 1e3:.1f})")
    kernel, sdpa = runs.values()
    print(f"  time SDPA / C++ kernel: {format_ratio(sdpa, kernel, word='')}")


def main() -> None:
    args = add_watch_argument(base_parser(__doc__)).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    auto = choose_backend("auto", "cpu")
    runnable = [n for n, (_, ok) in BACKENDS.items() if ok(torch.device("cpu"))]
    print(f"attention backend: {auto.name} (auto; runnable here: {', '.join(runnable)})\n")
    check_kernels(model.config, dtype)
    length = long_prompt(model, tok, dtype, args.repeats or 2)
    if load() is not None:
        attention_alone(model.config, dtype, length, args.repeats or 5)


if __name__ == "__main__":
    main()
