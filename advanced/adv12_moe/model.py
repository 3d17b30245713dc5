"""Lesson 04's model with a SparseMoE in place of the dense MLP on the sparse layers, and
lesson 04's strict loader for it.

Everything but the MLP is lesson 04's `CausalLM` (the attention, the norms, the RoPE tables, the
step attention it is handed), so lessons 12-16's engine runs this model unchanged: the engine
sees a module that maps (input_ids, positions, attn) to hidden states, as before.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from step04_transformer.loader import load_weights
from step04_transformer.model import CausalLM
from advanced.adv12_moe.config import MoEConfig
from advanced.adv12_moe.moe import SparseMoE

# Which experts a process holds, per sparse layer: None = all of them.
HeldExperts = Callable[[int], Iterable[int]] | None
EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


class MoECausalLM(CausalLM):
    def __init__(self, cfg: MoEConfig, held: HeldExperts = None):
        super().__init__(cfg)
        for i in cfg.sparse_layers:     # the others keep lesson 04's SwiGLU of intermediate_size
            self.model.layers[i].mlp = SparseMoE(cfg, i, None if held is None else held(i))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # Qwen3-MoE checkpoints keep an untied LM head. Lesson 14's packing turns it into a
        # PackedLinear, which has no .weight for lesson 04's matmul: call the module instead.
        if self.lm_head is None:
            return super().compute_logits(hidden)
        return self.lm_head(hidden).float()


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The sparse layers of a model (or of a transformed copy of one: look them up on the model
    the engine runs, since a transform such as pack_linears makes new module objects)."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def routing_counts(model: nn.Module) -> Tensor:
    """[sparse layers, E]: tokens the router sent to each expert since the last reset."""
    layers = moe_layers(model)
    return torch.stack([m.counts if m.counts is not None else torch.zeros(m.num_experts, dtype=torch.long)
                        for m in layers])


def reset_counts(model: nn.Module) -> None:
    for m in moe_layers(model):
        m.counts = None


def set_router_bias(model: nn.Module, bias: Tensor | None) -> None:
    """Add bias [sparse layers, E] (or [E] for all) to every router's logits; None removes it."""
    for i, m in enumerate(moe_layers(model)):
        m.router_bias = None if bias is None else (bias if bias.dim() == 1 else bias[i])


def keeps_only(held: HeldExperts, cfg: MoEConfig) -> Callable[[str], bool] | None:
    """The loader's filter: an expert tensor is read only by a process that holds that expert."""
    if held is None:
        return None
    owned = {i: set(held(i)) for i in cfg.sparse_layers}

    def keep(name: str) -> bool:
        m = EXPERT_TENSOR.match(name)
        return m is None or int(m.group(2)) in owned.get(int(m.group(1)), set())
    return keep


def load_moe_model(folder: str | Path, dtype: torch.dtype = torch.bfloat16, held: HeldExperts = None) -> MoECausalLM:
    """config.json -> empty model -> weights, exactly as lesson 04's load_model: every parameter
    filled from the checkpoint and every tensor read used, else an error naming it. held: the
    experts this process keeps (expert parallel); the other experts' tensors are not read."""
    cfg = MoEConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = MoECausalLM(cfg, held)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    load_weights(model, folder, dtype, keep=keeps_only(held, cfg))
    return model.eval().requires_grad_(False)
