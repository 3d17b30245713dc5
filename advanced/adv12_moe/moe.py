"""A Qwen3-MoE sparse layer: a router picks k experts per token, the experts run as one matmul
per expert over the tokens sorted by expert, the k outputs are mixed by the router's weights.

    x [T, H] --gate--> logits [T, E] --softmax, top-k--> weights [T, k], ids [T, k]
    (token, slot) pairs, T*k of them, sorted by expert id (a stable argsort):
        rows of expert 0 | rows of expert 1 | ... | rows of expert E-1      (x gathered in that order)
        one SwiGLU call per non-empty segment: a grouped matmul, E calls at most, never T
    outputs scattered back to (token, slot) order -> weighted sum over the k slots -> [T, H]

A dense MLP would read its weights once per step for all T tokens. An MoE layer reads only the
experts that some token chose, each once per step; with E experts and k per token, a token pays
for k small MLPs instead of one big one. Where the experts live (this process, or other ranks:
ep.py) is the layer's `expert_path`, a function; the router, the sort and the combine are the same.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from step04_transformer.layers import SwiGLU
from advanced.adv12_moe.config import MoEConfig


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).
    Softmax in float32 over all E experts, then the k largest; renormalised to sum to 1 when
    the config says so (Qwen3-MoE does), as transformers' Qwen3MoeTopKRouter."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """ids [T, k] -> (order, counts): order lists the flat (token, slot) pairs expert by expert
    (stable: within an expert, in token order); counts[e] is how many pairs chose expert e."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts).tolist()


def run_segments(rows: Tensor, counts: Iterable[int], expert: Callable[[int], nn.Module]) -> Tensor:
    """rows [N, H] sorted by expert, counts[e] rows for expert e -> outputs [N, H]: one call of
    expert e's MLP on its whole segment (a loop over experts, never over tokens)."""
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = expert(e)(rows[start:start + n])
            start += n
    return out


def grouped_experts(x: Tensor, ids: Tensor, num_experts: int, expert: Callable[[int], nn.Module]) -> Tensor:
    """Every (token, slot) pair through its expert: [T, H] -> [T, k, H]."""
    T, k = ids.shape
    order, counts = sort_by_expert(ids, num_experts)
    out_sorted = run_segments(x[order // k], counts, expert)     # row order // k is its token
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted                                       # back to (token, slot) order
    return out.view(T, k, -1)


def combine(per_slot: Tensor, weights: Tensor) -> Tensor:
    """[T, k, H] expert outputs, [T, k] router weights -> [T, H]: each token's weighted sum."""
    return (per_slot * weights.unsqueeze(-1)).sum(dim=1)


# An expert path: (layer, x [T, H], weights [T, k], ids [T, k]) -> [T, H].
ExpertPath = Callable[["SparseMoE", Tensor, Tensor, Tensor], Tensor]


def local_experts(moe: "SparseMoE", x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """Every expert in this process: sort, one matmul per expert, combine."""
    return combine(grouped_experts(x, ids, moe.num_experts, moe.expert), weights)


class SparseMoE(nn.Module):
    """Parameter names as the checkpoint's: mlp.gate.weight [E, H], mlp.experts.{e}.{gate,up,down}_proj.

    held: the expert ids this process holds (default all); an expert-parallel rank holds a few
    and the others are never built, so lesson 04's strict loader reads only those."""

    def __init__(self, cfg: MoEConfig, layer_idx: int, held: Iterable[int] | None = None):
        super().__init__()
        self.layer_idx, self.num_experts, self.top_k = layer_idx, cfg.num_experts, cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        held = range(cfg.num_experts) if held is None else sorted(set(held))
        # A ModuleDict keyed by expert id keeps the checkpoint's names with gaps ("experts.5" alone).
        self.experts = nn.ModuleDict({str(e): SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for e in held})
        self.expert_path: ExpertPath = local_experts
        self.router_bias: Tensor | None = None    # added to the logits: a skewed router for measurements
        self.counts: Tensor | None = None         # tokens routed to each expert since reset_counts

    def expert(self, e: int) -> nn.Module:
        return self.experts[str(e)]

    def router(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.gate(x)
        if self.router_bias is not None:
            logits = logits + self.router_bias.to(logits.dtype)
        return route(logits, self.top_k, self.normalize)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.router(x)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.counts = counts if self.counts is None else self.counts + counts
        return self.expert_path(self, x, weights, ids)
