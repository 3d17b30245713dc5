"""Quantized weights under the engine of lessons 15-16, and under lesson 19's `LLM`, unchanged.

The engine never sees a quantization scheme: it calls `model(input_ids, positions, attn)`
and the model calls its linears. Quantization is a model transform (linear.py), applied
before the model is handed to an engine, as lesson 14's packing is:

    engine = build_engine(quantize_model(model, W8A16), config, use_graph=False)   # lesson 16's, either part
    llm = quantized_llm(scheme=W8A16)            # lesson 19's LLM, its model's linears int8
    llm, report = q4_1_llm()                     # the embedded SmolLM2 on its own Q4_1 blocks
    llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16))

Lesson 19's LLM builds its engine from a folder, with no hook for a model transform, so the
two LLM helpers give the eager engine it built a quantized model afterwards (`use_model_`: the
engine's model and its runner's). Two engines cannot take that:
  - one that records its decode steps (lesson 16's graph runners): the recording would keep
    calling the old linears. Build it with `use_graph=False` (`LLM(enforce_eager=True)`);
  - lesson 17's tensor-parallel engine: its workers load their own shards in their own
    processes; only tensor_parallel_size=1 is quantized here.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from advanced.adv01_quantization.gguf_q4_1 import Q41Report, embedded_gguf, load_q4_1
from advanced.adv01_quantization.linear import count_quantized, quantize_model
from advanced.adv01_quantization.quantize import QuantScheme, W8A16
from minivllm_support.models import embedded_smollm2
from step04_transformer.loader import load_model
from step15_flash_attention.engine import ModelRunner
from step19_real_model.llm import LLM


def _check_engine(engine) -> None:
    if getattr(engine, "workers", None):
        raise ValueError("quantizing a tensor-parallel engine is not supported (each worker holds its own shard): "
                         "use tensor_parallel_size=1")
    if type(getattr(engine, "runner", None)) is not ModelRunner:
        raise ValueError("this engine records its decode steps with the linears it was built on (lesson 16's "
                         "graph runners): quantize the model before building the engine, or build it with "
                         "use_graph=False (LLM: enforce_eager=True)")


def use_model_(engine, model: nn.Module) -> None:
    """Give an eager engine (lesson 15's, or lesson 16's, either part, with use_graph=False) another model
    of the same shape: its KV pool, scheduler and sampler stay; a new eager runner calls `model`."""
    _check_engine(engine)
    if model.config != engine.model.config:
        raise ValueError("the new model must have the engine's model config (its KV pool is sized for it)")
    engine.model, engine.runner = model, ModelRunner(model)


def quantize_engine_(engine, scheme: QuantScheme, head: QuantScheme | None = None) -> int:
    """Give an eager engine its model quantized (quantize_model: the decoder linears and, with
    `head`, the LM head). Returns the number of quantized linears in the decoder layers."""
    _check_engine(engine)
    model = quantize_model(engine.model, scheme, head)
    use_model_(engine, model)
    return count_quantized(model.model.layers)


def quantized_llm(model: str | Path | None = None, scheme: QuantScheme = W8A16, head: QuantScheme | None = None,
                  **llm_options) -> LLM:
    """Lesson 19's LLM (eager) with its linears quantized by round-to-nearest."""
    llm = LLM(model, enforce_eager=True, **llm_options)
    quantize_engine_(llm.engine, scheme, head)
    return llm


def q4_1_llm(**llm_options) -> tuple[LLM, Q41Report]:
    """Lesson 19's LLM (eager) on the embedded SmolLM2, its linears on the GGUF file's own Q4_1 blocks.
    The blocks are found by layer name, so they go into the model as loaded (lesson 16's fast-path engine
    has fused q|k|v and gate|up): loaded once more, transformed, and given to the engine."""
    llm = LLM(embedded_smollm2(), enforce_eager=True, **llm_options)
    _check_engine(llm.engine)
    model, report = load_q4_1(load_model(llm.model_dir, llm.dtype), embedded_gguf())
    use_model_(llm.engine, model)
    return llm, report
