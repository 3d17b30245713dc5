"""What the benchmark scripts share: the Qwen3-0.6B-shaped random checkpoint, the bench
workload, filling an engine with decoding sequences, timing steps, the memory floor.

Measurement code, not a lesson: every lesson's bench.py and run.py may import it.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from minivllm_support.models import cache_dir
from step06_sampler.params import SamplingParams


QWEN3_06B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)


def random_qwen3_06b() -> Path:
    """A random-weight checkpoint of the Qwen3-0.6B shape, written once into our cache (bf16)."""
    path = cache_dir() / "qwen3-0.6b-shape-random"
    if not (path / "config.json").is_file():
        from transformers import Qwen3Config, Qwen3ForCausalLM
        print(f"[bench] writing a random Qwen3-0.6B-shaped checkpoint to {path} (once)")
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B_SHAPE)).to(torch.bfloat16).save_pretrained(str(path))
    return path


def workload(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    outs = [rng.randint(64, 256) for _ in range(n)]
    return prompts, outs


def fill(engine, batch: int, context: int, max_tokens: int, seed: int = 0) -> None:
    """Start `batch` sequences of about `context` tokens and run until every one is decoding."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Prompts share all but their last 8 tokens: the first computes the prefix, the others hit the
    # prefix cache (lesson 13), so setting up 64 x 360 tokens costs one prefill. Each sequence still
    # reads all its keys in every decode step: the step's work is as with distinct prompts.
    prefix = [rng.randrange(1000, vocab - 1000) for _ in range(context - 8)]
    seqs: list = []
    for group in (1, batch - 1):
        seqs += [engine.add_request(prefix + [rng.randrange(1000, vocab - 1000) for _ in range(8)], params)
                 for _ in range(group)]
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
            engine.step()                              # prefill, and each prompt's first token
    engine.step()                                      # one decode step untimed (first touch)


def time_steps(engine, steps: int) -> float:
    """Milliseconds per step over the next `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def step_turns(engines: dict, batch: int, context: int, steps: int, rounds: int,
               drain: bool = False) -> dict[str, float]:
    """Best milliseconds per decode step of each engine: each is filled with `batch` sequences
    of ~`context` tokens, then the engines take turns `rounds` times, `steps` steps a turn.
    drain: finish the sequences afterwards, so the next call starts from empty engines."""
    for engine in engines.values():
        fill(engine, batch, context, max_tokens=(rounds + 1) * steps + 8)
    best = {name: float("inf") for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            best[name] = min(best[name], time_steps(engine, steps))
    for engine in engines.values() if drain else ():
        while engine.has_unfinished():
            engine.step()
    return best


def make_engine(model, build, options: dict, max_num_seqs: int = 64, kv_gib: float = 3.5):
    """An engine from `build(model, config, **options)` (a lesson's build_engine, or an engine
    class), and the seconds building it took (recording buckets, compiling, packing)."""
    from step12_paged_attention.scheduler import PagedSchedulerConfig
    config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                  kv_cache_bytes=int(kv_gib * 2**30))
    t0 = time.perf_counter()
    engine = build(model, config, **options)
    return engine, time.perf_counter() - t0


def weight_floor(model) -> tuple[float, float, float]:
    """Bytes one decode step must read (every weight once; the embedding only as the LM head),
    the machine's read bandwidth (a float32 sum over 2 GiB), and their ratio."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = torch.ones(2**29, dtype=torch.float32)      # 2 GiB; a float32 sum is bound by memory, not by math
    big.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        big.sum()
    bandwidth = 3 * big.numel() * 4 / (time.perf_counter() - t0)
    return nbytes, bandwidth, bandwidth / nbytes
