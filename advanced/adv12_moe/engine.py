"""The single-process MoE engine: lesson 16's engine (CPU fast path) given the MoE model.

Lesson 16's transforms apply as they are: every nn.Linear packed for oneDNN, q|k|v fused, and
gate|up fused in every SwiGLU, each expert's included (an expert is lesson 04's SwiGLU). Its
recorded decode step does not: the number of rows each expert gets changes from step to step,
and the loop over experts reads those counts (`.tolist()`), which a captured graph or a
compiled bucket cannot hold. So the steps run eagerly (`use_graph=False`); vLLM gets around it
with a fused MoE kernel that takes the counts as a tensor.
"""
from __future__ import annotations

from torch import nn

from step12_paged_attention.scheduler import PagedSchedulerConfig
from step15_flash_attention.engine import Engine
from step16_cuda_graph.cpu.engine import build_engine


def build_moe_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, fast_path: bool = True,
                     **parts) -> Engine:
    """fast_path=False: lesson 15's engine with packed linears only (no fused projections)."""
    if not fast_path:
        from step15_flash_attention.engine import build_engine as lesson15
        return lesson15(model, config, **parts)
    return build_engine(model, config, use_graph=False, **parts)
