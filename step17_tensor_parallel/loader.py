"""Lesson 04's strict loader, sharded: each rank reads only its slices of the checkpoint.

`safe_open(...).get_slice(name)` maps the file and copies out only the rows (or columns) asked
for, so rank r of a 2-way split reads half of every linear, and no rank ever holds a full
weight in memory. The rules of lesson 04 stay: every checkpoint tensor is used, every
parameter is filled, every shape is checked (against the unsharded shape), or the load fails
naming the tensor.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from step04_transformer.config import ModelConfig
from step04_transformer.loader import check_all_filled, checkpoint_tensors
from step17_tensor_parallel.model import TPCausalLM


def load_sharded(model: TPCausalLM, folder: str | Path, keep: Callable[[str], bool] | None = None) -> None:
    """keep(name) False: the tensor belongs to another rank's part of the model (a pipeline stage
    of advanced lesson 06) and is not read."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())         # a tied head's weight is listed once, as the embedding
    tied = model.full_config.tie_word_embeddings
    filled: set[str] = set()
    stored_head = None
    for file, name, f in checkpoint_tensors(folder):
        if keep is not None and not keep(name):
            continue
        if tied and name == "lm_head.weight":
            stored_head = f.get_slice(name)       # a tied checkpoint may still store it: checked below
            continue
        owner, _, attr = name.rpartition(".")
        module = modules.get(owner)
        if module is not None and hasattr(module, "load_shard"):
            local = f"{owner}.{module.load_shard(name, attr, f.get_slice(name))}"
        elif name in params:                         # replicated: norms (every rank holds them whole)
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            local = name
        else:
            raise KeyError(f"checkpoint tensor {name!r} ({file}) matches no model parameter")
        if local in filled:
            raise KeyError(f"checkpoint tensor {name!r} appears twice")
        filled.add(local)
    if stored_head is not None:
        emb = model.model.embed_tokens      # this rank's rows (all of them when not split)
        start, end = getattr(emb, "start", 0), getattr(emb, "end", emb.weight.shape[0])
        mine = stored_head[start:end].to(emb.weight.dtype)
        if not torch.equal(mine, emb.weight[:end - start]):
            raise ValueError("config says tie_word_embeddings but the checkpoint's lm_head.weight differs "
                             "from model.embed_tokens.weight")
    check_all_filled(params, filled, folder)


def load_tp_model(folder: str | Path, rank: int, world: int, dtype: torch.dtype = torch.bfloat16) -> TPCausalLM:
    """Rank `rank`'s shard of the checkpoint in `folder`, in eval mode (lesson 04's load_model, sharded)."""
    cfg = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = TPCausalLM(cfg, rank, world)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    if cfg.tie_word_embeddings:          # to_empty gave the head its own tensor: share it again
        model.lm_head.linear.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        load_sharded(model, folder)
    return model.eval().requires_grad_(False)
