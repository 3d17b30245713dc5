"""Quantized weights under the engine of lessons 16-20, and under lesson 20's `LLM`, unchanged.

The engine never sees a quantization scheme: it calls `model(input_ids, positions, attn)`
and the model calls its linears. Swapping the linears (after loading, the way vLLM's
`process_weights_after_loading` repacks them) is all it takes:

    llm = quantized_llm(scheme=W8A16)            # lesson 20's LLM, linears swapped to int8
    llm = q4_1_llm()                             # the embedded SmolLM2 on its own Q4_1 blocks
    llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16))

Two things the swap has to respect:
  - lesson 16's graph runner records the decode step with the linears it found; swapping
    afterwards would leave the recorded step reading the old ones. So the engine must be
    eager (`use_graph=False`; `LLM(enforce_eager=True)`), and quantize_engine_ refuses otherwise.
  - lesson 18's tensor-parallel workers load their own shards in their own processes; only
    tensor_parallel_size=1 is quantized here.
The LM head is not a linear of the model (it is the tied embedding): lesson 16's engine keeps a
packed copy of it in `engine.lm_head`, and `head=` replaces that copy by a quantized one.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from advanced.adv01_quantization.gguf_q4_1 import Q41Report, embedded_gguf, load_q4_1_
from advanced.adv01_quantization.linear import dense_weight, quantize_, quantized_linear
from advanced.adv01_quantization.quantize import QuantScheme, W8A16, quantize
from minivllm_support.models import embedded_smollm2
from step20_real_model.llm import LLM


def _check_engine(engine) -> None:
    if getattr(engine, "runner", None) is not None:
        raise ValueError("this engine recorded its decode steps with the unquantized linears (lesson 16's "
                         "graph runner): build it with use_graph=False (LLM: enforce_eager=True), then quantize")
    if getattr(engine, "workers", None):
        raise ValueError("quantizing a tensor-parallel engine is not supported (each worker holds its own shard): "
                         "use tensor_parallel_size=1")


def head_weight(engine):
    """The LM head's weight as the engine reads it: its packed copy, else the (tied) embedding."""
    if getattr(engine, "lm_head", None) is not None:
        return dense_weight(engine.lm_head)[0]
    model = engine.model
    return model.model.embed_tokens.weight if model.lm_head is None else dense_weight(model.lm_head)[0]


def quantize_engine_(engine, scheme: QuantScheme, head: QuantScheme | None = None) -> int:
    """Quantize the decoder linears of `engine.model` in place and, with `head`, the LM head the
    engine multiplies by (lesson 16's `engine.lm_head`). Returns the number of linears swapped."""
    _check_engine(engine)
    if head is not None and not hasattr(engine, "lm_head"):
        raise ValueError(f"{type(engine).__name__} has no lm_head to replace (lesson 16's engine and later have)")
    done = quantize_(engine.model, scheme)
    if head is not None:
        dtype = engine.model.model.embed_tokens.weight.dtype
        engine.lm_head = quantized_linear(quantize(head_weight(engine), head, "lm_head"), dtype)
    return done


def quantized_llm(model: str | Path | None = None, scheme: QuantScheme = W8A16, head: QuantScheme | None = None,
                  **llm_options) -> LLM:
    """Lesson 20's LLM (eager) with its linears quantized by round-to-nearest."""
    llm = LLM(model, enforce_eager=True, **llm_options)
    quantize_engine_(llm.engine, scheme, head)
    return llm


def q4_1_llm(**llm_options) -> tuple[LLM, Q41Report]:
    """Lesson 20's LLM (eager) on the embedded SmolLM2, its linears on the GGUF file's own Q4_1 blocks."""
    llm = LLM(embedded_smollm2(), enforce_eager=True, **llm_options)
    _check_engine(llm.engine)
    return llm, load_q4_1_(llm.engine.model, embedded_gguf())


def count_linears(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())
