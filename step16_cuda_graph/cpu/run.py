"""Lesson 16, part 2: the CPU fast path. Lesson 16's engine with and without its fast path, built from the same model,
on the same prompts.

1. what lesson 16 + fast path builds here: the model transforms (lesson 14's packed linears, q|k|v and
   gate|up fused, the packed linears routed through our op; each returns a new model, the one
   given is left as it was), the runner (each bucket's compiled body called directly, prompt
   steps through a compiled body with a dynamic token count), the packed LM head, the C
   argmax; and how long each engine took to build;
2. eight chat requests through lesson 16 and lesson 16 + fast path: same answers, wall time (in bf16 the
   two round their element-wise chains differently, so the same requests run again in
   float32, where the tests hold lesson 16 + fast path to the tokens of the earlier lessons);
3. decode throughput at batch 1 and 8 (context ~360 tokens), the two engines taking turns; at batch 1
   also the fast path with its one-call decode step turned off (`one_call=False`: the layers of
   the small buckets compiled like the others), to show what that one C call buys.
Where this machine cannot compile the step (no C++ compiler), the fast path's build_engine returns
lesson 16's engine, and the script says so.
"""
from __future__ import annotations

import time

import torch

from minivllm_support.cli import base_parser, identity_line
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from step16_cuda_graph.decode_timing import step_turns
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step14_batched_forward import kernel as lesson14_kernel
from step14_batched_forward.packed_linear import PackedLinear, count_modules
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.run import QUESTIONS, config     # lesson 16's questions and engine settings
from step16_cuda_graph.cpu import engine as fast_path
from step16_cuda_graph.cpu import ops
from step16_cuda_graph.cpu.fused import count_fused
from step16_cuda_graph.cpu.ops import OpPackedLinear
from step16_cuda_graph.cpu.runner import CpuGraphRunner


def build(name: str, build_engine, model, **options):
    t0 = time.perf_counter()
    engine = build_engine(model, config(), **options)
    secs = time.perf_counter() - t0
    runner = engine.runner
    print(f"{name}: built in {secs:4.1f} s (recording {len(runner.buckets)} buckets"
          f"{' and compiling the prompt step' if isinstance(runner, CpuGraphRunner) else ''}: "
          f"{getattr(runner, 'record_seconds', 0.0):4.1f} s), runner {type(runner).__name__} ({runner.mode})")
    return engine


def describe(engine, model) -> bool:
    """What lesson 16 + fast path changed in the engine it built; False if it is lesson 16's engine."""
    runner, m = engine.runner, engine.model
    if not isinstance(runner, CpuGraphRunner):
        print("  lesson 16 + fast path cannot compile the step here (a GPU, no C++ compiler, or another attention backend):"
              " its build_engine returned lesson 16's engine")
        return False
    layers = model.config.num_layers
    print(f"  model: {count_modules(m, OpPackedLinear)} packed linears through our op "
          f"({count_fused(m)} of {2 * layers} attention/MLP blocks fused: q|k|v and gate|up one matmul each); "
          f"the model handed in: {count_modules(model, PackedLinear)} packed (each transform returned a new model)")
    elementwise = any(getattr(layer.mlp, "kernels", False) for layer in m.model.layers)
    where = (f"elementwise.cpp ({lesson14_kernel.isa(ops.kernels_library())} build)" if elementwise
             else "torch's ops, fused by the compiler (elementwise.cpp is for bf16)")
    print(f"  element-wise chains after the fused projections: {where}")
    head = "a packed copy of the embedding" if runner.lm_head is not None else "the model's own"
    one_call = sorted(runner.one_call_steps)
    print(f"  decode steps of one to four rows, every layer in one C call (decode_step.cpp): buckets {one_call or 'none'}"
          + ("" if one_call else " (it takes bf16 models on a CPU with AVX-512 BF16)"))
    print(f"  buckets called without Dynamo: {sorted(runner.direct)}; prompt steps: "
          f"{'one compiled body, token count dynamic' if runner.mixed else 'eager'}; LM head: {head}; "
          f"greedy pick: {type(engine.sampler).__name__} (one C pass over the logits)")
    return True


def chat(engines: dict, tok, dtype) -> None:
    prompts, sp = [chat_prompt_ids(tok, q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for name, eng in engines.items():
        t0 = time.perf_counter()
        outs[name] = [s.output_token_ids for s in eng.generate(prompts, sp)]
        print(f"  {name}: {sum(map(len, outs[name]))} tokens in {time.perf_counter() - t0:5.2f} s, "
              f"{eng.num_steps} steps")
    a, b = outs.values()
    print(f"  Q: {QUESTIONS[0]}\n  A: {tok.decode(b[0], skip_special_tokens=True).strip()!r}")
    print("  " + identity_line("answers of lesson 16 and lesson 16 + fast path", sum(x == y for x, y in zip(a, b)), len(a), dtype))


def float32_answers(folder, tok) -> None:
    """The same requests through both engines built from the float32 model (the tests' comparison)."""
    t0 = time.perf_counter()
    model = load_model(folder, torch.float32)
    prompts, sp = [chat_prompt_ids(tok, q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=48)
    a, b = ([s.output_token_ids for s in build_engine(model, config()).generate(prompts, sp)]
            for build_engine in (lesson16.build_engine, fast_path.build_engine))
    print("  float32: " + identity_line("answers of lesson 16 and lesson 16 + fast path", sum(x == y for x, y in zip(a, b)),
                                        len(a), torch.float32) + f" ({time.perf_counter() - t0:.1f} s)")


def decode_throughput(engines: dict, batch1_extra: dict, batches=(1, 8), context: int = 360, steps: int = 16,
                      rounds: int = 3) -> None:
    """batch1_extra: engines that take their turns at batch 1 only."""
    print(f"\ndecode throughput, context ~{context} tokens (the engines take turns, {steps} steps a turn, "
          f"best of {rounds}):")
    for b in batches:
        turns = {**engines, **batch1_extra} if b == 1 else engines
        best = step_turns(turns, b, context, steps, rounds, drain=True)   # drained: the next batch starts empty
        tok_s = {name: b * 1e3 / ms for name, ms in best.items()}
        print(f"  batch {b}: " + ", ".join(f"{name} {t:6.1f} tok/s ({best[name]:5.1f} ms a step)"
                                           for name, t in tok_s.items())
              + f"  -> lesson 16 + fast path / lesson 16 = {tok_s['lesson 16 + fast path'] / tok_s['lesson 16']:.2f}x")
        for name in batch1_extra if b == 1 else ():
            print(f"           lesson 16 + fast path / {name} = {tok_s['lesson 16 + fast path'] / tok_s[name]:.2f}x")


def main() -> None:
    args = base_parser(__doc__).parse_args()
    dtype, folder, model, tok = start_lesson(args)
    engines = {"lesson 16": build("lesson 16", lesson16.build_engine, model),
               "lesson 16 + fast path": build("lesson 16 + fast path", fast_path.build_engine, model)}
    fast = engines["lesson 16 + fast path"]
    describe(fast, model)
    extra = {}
    if getattr(fast.runner, "one_call_steps", None):
        name = "fast path, layers compiled"
        extra[name] = build(name, fast_path.build_engine, model, one_call=False)
    print("\neight chat requests, greedy, up to 48 tokens:")
    chat(engines, tok, dtype)
    if dtype != torch.float32:
        float32_answers(folder, tok)
    decode_throughput(engines, extra)


if __name__ == "__main__":
    main()
