"""Advanced lesson 13: a hybrid (gated DeltaNet + attention) against an attention-only model of the
same shape: memory per sequence and decode time per step as the context grows, the state's size
against the KV cache's, and what caching a prefix of a state would cost.

Both models are Qwen3-Next checkpoints with random weights, made here with transformers at a
small shape (checkpoint.py says why): they differ only in `layer_types`.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from minivllm_support.cli import DTYPES, machine, setup
from minivllm_support.timing import busy_warning
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from advanced.adv13_linear_attention.checkpoint import build_hybrid_checkpoint
from advanced.adv13_linear_attention.config import FULL, LINEAR, HybridConfig
from advanced.adv13_linear_attention.engine import build_hybrid_engine, kv_bytes_held, state_bytes_held
from advanced.adv13_linear_attention.model import HybridLM, load_hybrid
from advanced.adv13_linear_attention.prefix_state import build_state_prefix_engine, copy_slots

SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
             max_position_embeddings=8192, eos_token_id=None)
BLOCK = 16


def kib(n: float) -> str:
    return f"{n / 2**10:,.0f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def build_models(folder: str, dtype: torch.dtype) -> dict[str, HybridLM]:
    hybrid = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(SHAPE["num_hidden_layers"])]
    kinds = {"hybrid": hybrid, "attention-only": [FULL] * SHAPE["num_hidden_layers"]}
    return {name: load_hybrid(build_hybrid_checkpoint(f"{folder}/{name}", seed=0, **SHAPE, layer_types=types), dtype)
            for name, types in kinds.items()}


def measure(model: HybridLM, context: int, batch: int, steps: int) -> dict:
    """`batch` requests of `context` random tokens: prefill them (timed as a whole), note what
    they hold, then time `steps` decode steps one by one."""
    config = PagedSchedulerConfig(block_size=BLOCK, max_num_seqs=batch, max_num_batched_tokens=2048,
                                  kv_cache_bytes=batch * (context + steps + BLOCK) * model.config.kv_bytes_per_token * 2)
    g = torch.Generator().manual_seed(context)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    with build_hybrid_engine(model, config) as engine:
        seqs = [engine.add_request(torch.randint(3, SHAPE["vocab_size"], (context,), generator=g).tolist(), params)
                for _ in range(batch)]
        start = time.perf_counter()
        while any(not s.output_token_ids for s in seqs):
            engine.step()
        prefill = time.perf_counter() - start
        held = {"kv": kv_bytes_held(engine) / batch, "state": state_bytes_held(engine) / batch}
        times = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return {"prefill_s": prefill, "decode_ms": 1e3 * statistics.median(times), **held,
                "state_slot": engine.state_pool.bytes_per_slot, "backend": engine.attention.name}


def checkpoint_copy_seconds(model: HybridLM, repeats: int = 20) -> float:
    """Time to copy one sequence's whole state (every linear layer's conv and delta state): what
    saving a prefix checkpoint costs in time."""
    engine = build_state_prefix_engine(model, PagedSchedulerConfig(block_size=BLOCK, max_num_seqs=2,
                                                                   kv_cache_bytes=2**20), checkpoints=1)
    t = time.perf_counter()
    for _ in range(repeats):
        copy_slots(engine.state_pool, engine.checkpoint_pool, [(0, 0)])
    return (time.perf_counter() - t) / repeats


def shared_prefix(model: HybridLM, prefix: int, requests: int = 4) -> dict:
    """`requests` prompts of one shared `prefix` plus 16 own tokens, 8 greedy tokens each: the
    first alone, then the others together, through the plain hybrid engine and through the one
    with state checkpoints. Times and prompt tokens computed are for the later requests."""
    g = torch.Generator().manual_seed(7)
    head = torch.randint(3, SHAPE["vocab_size"], (prefix,), generator=g).tolist()
    prompts = [head + torch.randint(3, SHAPE["vocab_size"], (16,), generator=g).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = PagedSchedulerConfig(block_size=BLOCK, max_num_seqs=requests, max_num_batched_tokens=2048,
                                  kv_cache_bytes=4 * requests * (prefix + 32) * model.config.kv_bytes_per_token)
    out = {}
    for name, build in (("plain", lambda: build_hybrid_engine(model, config)),
                        ("checkpoints", lambda: build_state_prefix_engine(model, config, checkpoints=32))):
        with build() as engine:
            first = engine.generate(prompts[:1], params)
            before, t = engine.prompt_tokens, time.perf_counter()
            rest = engine.generate(prompts[1:], params)
            out[name] = {"seconds": time.perf_counter() - t, "prompt_tokens": engine.prompt_tokens - before,
                         "tokens": [s.output_token_ids for s in first + rest]}
            if name == "checkpoints":
                ck = engine.scheduler.checkpoints
                out[name].update(saved=ck.num_saved, restored=ck.num_restored, held=len(ck.slot_of_hash),
                                 bytes=engine.checkpoint_bytes, hit=engine.scheduler.block_manager.hit_rate)
    return out


def real_shape_line() -> str:
    """Qwen3-Next-80B-A3B's shape (transformers' Qwen3NextConfig defaults), bf16 KV and conv
    state, float32 delta state: computed from the shapes, not measured."""
    from transformers import Qwen3NextConfig
    cfg = HybridConfig.from_dict({**Qwen3NextConfig().to_dict(), "num_experts": 0,
                                  "architectures": ["Qwen3NextForCausalLM"]})
    (c, k), (h, dk, dv) = cfg.state_shapes()
    state = len(cfg.linear_layers) * (c * k * 2 + h * dk * dv * 4)
    kv = cfg.kv_bytes_per_token
    return (f"  Qwen3-Next-80B-A3B's shape ({len(cfg.linear_layers)} DeltaNet + {len(cfg.attention_layers)} attention "
            f"layers), computed from its config: state {kib(state)} per sequence, KV {kib(kv)} per token of the "
            f"attention layers; the state equals the KV of {state / kv:,.0f} tokens, and a block of {BLOCK} tokens "
            f"holds {kib(kv * BLOCK)} of KV against {kib(state)} for a state checkpoint")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--batch", type=int, default=2, help="requests decoding together")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per context (the median is shown)")
    p.add_argument("--quick", action="store_true", help="contexts 256, 1024, 4096 only")
    args = p.parse_args()
    dtype = setup(args)
    contexts = [256, 1024, 4096] if args.quick else args.contexts
    if max(contexts) + args.steps + 1 > SHAPE["max_position_embeddings"]:
        p.error(f"contexts must stay below {SHAPE['max_position_embeddings'] - args.steps - 1}")
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(folder, dtype)
    for name, m in models.items():
        c = m.config
        print(f"{name:>15}: {sum(x.numel() for x in m.parameters()) / 1e6:.2f} M parameters (random), "
              f"{len(c.linear_layers)} DeltaNet + {len(c.attention_layers)} attention layers, {args.dtype}")
    models["hybrid"](torch.arange(8), torch.arange(8))            # first calls pay one-time costs
    models["attention-only"](torch.arange(8), torch.arange(8))
    if warning := busy_warning():
        print(warning)
    print(f"\n{args.batch} requests of C random tokens each: prefill (not the subject), then {args.steps} "
          f"decode steps; memory held per request, median decode step")
    print(f"{'C':>6} | {'hybrid KV':>10} {'state':>9} {'total':>10} {'step ms':>8} | "
          f"{'attn-only KV':>12} {'step ms':>8} | {'memory':>7} {'step':>6}")
    rows = {}
    for ctx in contexts:
        h, a = (measure(models[n], ctx, args.batch, args.steps) for n in ("hybrid", "attention-only"))
        rows[ctx] = (h, a)
        total = h["kv"] + h["state"]
        print(f"{ctx:>6} | {kib(h['kv']):>10} {kib(h['state']):>9} {kib(total):>10} {h['decode_ms']:>8.2f} | "
              f"{kib(a['kv']):>12} {a['decode_ms']:>8.2f} | {a['kv'] / total:>6.2f}x {a['decode_ms'] / h['decode_ms']:>5.2f}x")
    lo, hi = contexts[0], contexts[-1]
    for name, i in (("hybrid", 0), ("attention-only", 1)):
        print(f"  {name}: decode step at C={hi} / at C={lo}: {rows[hi][i]['decode_ms'] / rows[lo][i]['decode_ms']:.2f}x; "
              f"prefill of {args.batch} x {hi} tokens {rows[hi][i]['prefill_s']:.2f} s")
    print(f"  attention backend: {rows[lo][0]['backend']}; last two columns: attention-only / hybrid")

    h = models["hybrid"].config
    slot = rows[lo][0]["state_slot"]
    kv_token = h.kv_bytes_per_token * torch.empty((), dtype=dtype).element_size() // 2
    print(f"\nstate vs KV, hybrid ({args.dtype}): one sequence's state {kib(slot)} (conv + delta, every DeltaNet layer, "
          f"any length); KV of its attention layers {kib(kv_token)} per token; the state equals the KV of "
          f"{slot / kv_token:,.0f} tokens")
    attn_token = models["attention-only"].config.kv_bytes_per_token * torch.empty((), dtype=dtype).element_size() // 2
    print(f"  attention-only: {kib(attn_token)} per token, no state; the hybrid holds less from "
          f"{slot / (attn_token - kv_token):,.0f} tokens of context on (state / KV saved per token)")
    copy = checkpoint_copy_seconds(models["hybrid"])
    print(f"\nprefix caching for a state: a cache hit must restore the state after exactly the cached tokens,")
    print(f"so the cache keeps a state checkpoint per reusable boundary (here: per block of {BLOCK} tokens):")
    print(f"  per block: KV {kib(kv_token * BLOCK)} (attention layers) + checkpoint {kib(slot)} = "
          f"{(kv_token * BLOCK + slot) / (kv_token * BLOCK):.0f}x the KV alone")
    print(f"  a {hi}-token prefix: KV {kib(kv_token * hi)}; checkpoints at every block {kib(slot * hi // BLOCK)}, "
          f"at its end only {kib(slot)}")
    print(f"  saving one checkpoint (copying the state, measured): {1e6 * copy:.0f} us; recomputing it "
          f"(prefill of {hi} tokens, per request, measured above): {rows[hi][0]['prefill_s'] / args.batch * 1e3:.0f} ms")
    prefix = min(1024, hi)
    sp = shared_prefix(models["hybrid"], prefix)
    plain, ck = sp["plain"], sp["checkpoints"]
    print(f"  measured, 4 requests sharing a {prefix}-token prefix (+16 own tokens, 8 generated), the first one "
          f"alone, then the other 3:")
    print(f"    plain hybrid engine:     {plain['prompt_tokens']:5d} prompt tokens computed, {plain['seconds']:.2f} s")
    print(f"    with state checkpoints:  {ck['prompt_tokens']:5d} prompt tokens computed, {ck['seconds']:.2f} s; "
          f"hit rate {100 * ck['hit']:.0f}%, {ck['saved']} checkpoints saved, {ck['restored']} restored, "
          f"{ck['held']} held = {kib(ck['bytes'])}")
    same = sum(a == b for a, b in zip(plain["tokens"], ck["tokens"]))
    print(f"    identical outputs, checkpoints vs plain: {same}/{len(plain['tokens'])}")
    print(real_shape_line())


if __name__ == "__main__":
    main()
