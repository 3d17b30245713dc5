"""The measurements of run.py: one batch of requests over 1, 4 or 16 adapters, three ways.

    LoRA batch      one LoRAEngine, every request with its adapter, all in one batch
    merged          per adapter, W + scaling B A merged into the weights of lesson 15's engine
                    and that adapter's requests run, one adapter after another (what a server
                    without multi-LoRA does: one model at a time, weights swapped between them)
    base            the same requests on the base model alone (lesson 15's engine)

Throughput is generated tokens over the seconds of the engine's step loops; building engines and
merging weights are timed apart, as set-up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import PackedLinear, can_pack
from step15_flash_attention.engine import build_engine

from .adapters import LoRAAdapter, LoRARequest, load_adapter
from .engine import build_lora_engine


@dataclass
class Run:
    tokens: list[list[int]]         # each request's generated tokens, in request order
    seconds: float                  # the step loops
    setup_seconds: float = 0.0      # engines built, weights merged

    @property
    def tok_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


def step_loop(engine, prompts: list[list[int]], max_tokens: int, loras: list[LoRARequest | None] | None = None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    loras = loras or [None] * len(prompts)
    kwargs = [{"lora_request": lr} if lr is not None else {} for lr in loras]
    seqs = [engine.add_request(p, params, **kw) for p, kw in zip(prompts, kwargs)]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs], time.perf_counter() - start


def warm(engine, warm_prompt: list[int], lora: LoRARequest | None = None) -> None:
    """One short untimed request: first-call costs (oneDNN kernel choice, page faults) paid here."""
    step_loop(engine, [warm_prompt] * 2, 4, [lora] * 2)


def lora_batch(model: nn.Module, config: PagedSchedulerConfig, prompts, loras, max_tokens: int, warm_prompt,
               max_loras: int, strategy: str) -> tuple[Run, object]:
    start = time.perf_counter()
    engine = build_lora_engine(model, config, max_loras=max_loras, max_lora_rank=16, lora_strategy=strategy)
    for lr in {lr for lr in loras if lr is not None}:
        engine.loras.register(lr)
    warm(engine, warm_prompt, next((lr for lr in loras if lr is not None), None))
    setup = time.perf_counter() - start
    tokens, seconds = step_loop(engine, prompts, max_tokens, loras)
    return Run(tokens, seconds, setup), engine


def base_alone(model: nn.Module, config: PagedSchedulerConfig, prompts, max_tokens: int, warm_prompt) -> Run:
    engine = build_engine(model, config)
    warm(engine, warm_prompt)
    return Run(*step_loop(engine, prompts, max_tokens))


def _parent(model: nn.Module, i: int, name: str) -> nn.Module:
    layer = model.model.layers[i]
    return layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp


def swap_in_merged(engine_model: nn.Module, base: nn.Module, adapter: LoRAAdapter) -> dict:
    """Give the engine's model W + B A * scaling (PEFT's merge) on each adapted projection: a new
    linear (packed as lesson 14 packs, where it can) put in place of the engine's. Returns the
    modules replaced, for swap_out. `base` (the unpacked model) is read, never changed."""
    replaced = {}
    for (i, name), (a, bt) in adapter.weights.items():
        w = getattr(_parent(base, i, name), name).weight
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_((w.float() + bt.float().t() @ a.float()).to(w.dtype))   # B^T holds the scaling
        parent = _parent(engine_model, i, name)
        replaced[(i, name)] = getattr(parent, name)
        setattr(parent, name, PackedLinear(linear) if can_pack(w.dtype) else linear.requires_grad_(False))
    return replaced


def swap_out(engine_model: nn.Module, replaced: dict) -> None:
    for (i, name), module in replaced.items():
        setattr(_parent(engine_model, i, name), name, module)


def merged_per_adapter(model: nn.Module, config: PagedSchedulerConfig, prompts, loras, max_tokens: int,
                       warm_prompt) -> Run:
    """One lesson 15 engine; per adapter, its merged weights swapped in, its requests run, the base
    weights swapped back: the adapters one after another, as a server of one model at a time."""
    cfg, dtype = model.config, model.model.embed_tokens.weight.dtype
    shapes = {name: (getattr(_parent(model, 0, name), name).in_features, getattr(_parent(model, 0, name), name).out_features)
              for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    start = time.perf_counter()
    engine = build_engine(model, config)
    warm(engine, warm_prompt)
    tokens: list[list[int] | None] = [None] * len(prompts)
    seconds, setup = 0.0, time.perf_counter() - start
    for lr in dict.fromkeys(loras):                    # adapters in first-use order
        start = time.perf_counter()
        replaced = swap_in_merged(engine.model, model, load_adapter(lr, shapes, cfg.num_layers, dtype))
        setup += time.perf_counter() - start
        try:
            mine = [i for i, x in enumerate(loras) if x == lr]
            out, s = step_loop(engine, [prompts[i] for i in mine], max_tokens)
        finally:
            swap_out(engine.model, replaced)
        seconds += s
        for i, t in zip(mine, out):
            tokens[i] = t
    return Run(tokens, seconds, setup)


def same_tokens(a: Run, b: Run) -> int:
    return sum(x == y for x, y in zip(a.tokens, b.tokens))

