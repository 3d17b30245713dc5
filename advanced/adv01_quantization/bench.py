"""Speed on the Qwen3-0.6B shape: bf16 (lesson 14's packed linears) against W8A16 and W4A16.

Random weights: speed does not depend on what the numbers are. One model, one engine; the
variants are sets of linear modules swapped into the same slots between timings, so every
variant runs the same sequences on the same KV pool, taking turns (timing.compare).

    bytes        what one decode step must read: every linear once, and the LM head
    rows sweep   the 28 gate_proj linears (1024 -> 3072) at 1 to 64 rows: where each kernel wins
    decode step  lesson 16's engine (eager), B sequences decoding, engine.step() each

The timings swap modules in place on purpose (one engine, one KV pool, the same sequences for
every variant); everything else in this lesson uses the transforms of linear.py.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from advanced.adv01_quantization.linear import Int8Linear, quantized_linear, weight_bytes, with_head
from advanced.adv01_quantization.quantize import QuantScheme, quantize
from minivllm_support.timing import Timing, compare
from step04_transformer.config import ModelConfig
from step04_transformer.model import CausalLM
from step12_paged_attention.scheduler import PagedSchedulerConfig
from minivllm_support.workloads import QWEN3_06B_SHAPE
from step14_batched_forward.packed_linear import PackedLinear
from step16_cuda_graph.engine import build_engine
from step16_cuda_graph.decode_timing import fill


def random_model(shape: dict = QWEN3_06B_SHAPE, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> CausalLM:
    """The model of `shape`, built in memory, every weight N(0, 0.02). Drawing 600M normal numbers
    takes longer than the whole benchmark, so one pool of 2^20 draws is copied around at random
    offsets: the values do not matter for speed, only that each tensor is its own memory."""
    cfg = ModelConfig.from_dict({**shape, "architectures": ["Qwen3ForCausalLM"]})
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(seed)
    chunk = 2**20
    pool = (torch.randn(2 * chunk, generator=g) * 0.02).to(dtype)
    for name, p in model.named_parameters():
        flat = p.view(-1)
        if "norm" in name:
            flat.fill_(1.0)
            continue
        for start in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - start)
            off = int(torch.randint(0, chunk, (1,), generator=g))
            flat[start:start + n].copy_(pool[off:off + n])
    return model.eval().requires_grad_(False)


def linear_slots(model: CausalLM) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every decoder linear, in the order a forward calls them."""
    return [(parent, name) for layer in model.model.layers for parent in (layer.self_attn, layer.mlp)
            for name, child in parent.named_children() if isinstance(child, (nn.Linear, PackedLinear))]


@dataclass
class Variant:
    name: str
    linears: list[nn.Module]
    head: nn.Module                     # what the engine's model's lm_head becomes (a ModuleHeadLM)
    bytes_linears: int
    bytes_head: int

    def install(self, slots, engine=None) -> None:
        for (parent, attr), module in zip(slots, self.linears):
            setattr(parent, attr, module)
        if engine is not None:
            engine.model.lm_head = self.head

    @property
    def bytes(self) -> int:
        return self.bytes_linears + self.bytes_head


def build_variants(model: CausalLM, schemes: dict[str, tuple[QuantScheme | None, QuantScheme | None]]
                   ) -> tuple[list[Variant], dict[str, float]]:
    """name -> (scheme of the linears, scheme of the head); None = bf16, packed as in lesson 14.
    Variants with the same scheme share modules. The model's nn.Linear weights are dropped at the
    end. Also returns the seconds each scheme took to quantize (a load-time cost)."""
    dtype = model.model.embed_tokens.weight.dtype
    slots = linear_slots(model)
    originals = [getattr(parent, attr) for parent, attr in slots]
    tied = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    tied.weight = model.model.embed_tokens.weight              # tied: the head is the embedding

    def make(linear: nn.Linear, scheme: QuantScheme | None, name: str) -> nn.Module:
        if scheme is None:
            return PackedLinear(linear)
        return quantized_linear(quantize(linear.weight, scheme, name), dtype)

    made: dict[tuple, list[nn.Module]] = {}
    seconds: dict[str, float] = {}
    for part, mods, scheme in [(p, m, s) for lin, head in schemes.values()
                               for p, m, s in (("linears", originals, lin), ("head", [tied], head))]:
        if (part, scheme) not in made:
            t0 = time.perf_counter()
            made[part, scheme] = [make(m, scheme, f"{part} {i}") for i, m in enumerate(mods)]
            if scheme is not None:
                seconds[f"{scheme.name} {part}"] = time.perf_counter() - t0
    out = []
    for name, (lin, head) in schemes.items():
        linears, h = made["linears", lin], made["head", head][0]
        out.append(Variant(name, linears, h, sum(map(weight_bytes, linears)), weight_bytes(h)))
    out[0].install(slots)                                      # the nn.Linear originals can go now
    return out, seconds


def rows_sweep(variants: dict[str, list[nn.Module]], rows: list[int], repeats: int = 3) -> dict[int, dict[str, Timing]]:
    """Each variant's list of linears (same shapes) called once each, on [r, in] inputs."""
    out = {}
    for r in rows:
        k = next(iter(variants.values()))[0].in_features
        x = torch.randn(r, k).to(torch.bfloat16)

        def run(mods: list[nn.Module]):
            def call_all() -> None:
                for m in mods:
                    m(x)
            return call_all
        out[r] = compare({name: run(mods) for name, mods in variants.items()}, repeats=repeats)
    return out


def with_dequant_rows(modules: list[nn.Module], rows: int | None) -> list[nn.Module]:
    """Shallow copies of Int8Linears (same weight tensors) that switch to the bf16 matmul above `rows`."""
    out = []
    for m in modules:
        assert isinstance(m, Int8Linear)
        c = copy.copy(m)
        c.dequant_rows = rows
        out.append(c)
    return out


def time_decode(model: CausalLM, variants: list[Variant], batch: int, context: int, steps: int,
                repeats: int) -> dict[str, Timing]:
    """`steps` engine steps of `batch` decoding sequences per timed run, the variants taking turns
    on one engine (its sequences started once, with the first variant)."""
    slots = linear_slots(model)
    total = context + (repeats + 1) * len(variants) * steps + 16
    kv = batch * total * model.config.kv_bytes_per_token
    config = PagedSchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=512, kv_cache_bytes=int(kv * 1.2))
    variants[0].install(slots)
    # Lesson 16's engine without graphs, on a shallow copy of `model` whose logits come from a head
    # module (linear.with_head): its decoder is `model`'s, so the slots are the engine's too.
    engine = build_engine(with_head(model, variants[0].head), config, use_graph=False, pack_weights=False)
    fill(engine, batch, context, max_tokens=total - context)

    def run(v: Variant):
        def decode_steps() -> None:
            v.install(slots, engine)
            for _ in range(steps):
                engine.step()
        return decode_steps
    timings = compare({v.name: run(v) for v in variants}, repeats=repeats)
    variants[0].install(slots, engine)
    return timings
