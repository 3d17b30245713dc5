"""A strict safetensors loader: every checkpoint tensor is used, every parameter is filled.

A silent partial load (a renamed tensor skipped, a parameter left at its random init) is the
worst bug an inference engine can have: the model still runs and prints fluent nonsense.
So anything that does not line up is an error that names the tensor.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from step04_transformer.config import ModelConfig
from step04_transformer.model import CausalLM

# Tensors some checkpoints carry that are not parameters (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_tensors(folder: str | Path) -> Iterator[tuple[str, str, object]]:
    """(file name, tensor name, open safetensors file) for every tensor of the checkpoint."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(folder)!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(IGNORED_SUFFIXES):
                    yield file.name, name, f


def check_all_filled(params, filled: set[str], folder: str | Path) -> None:
    missing = sorted(set(params) - filled)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"checkpoint in {str(folder)!r} is missing tensors: {missing[:5]}{more}")


def load_weights(model: torch.nn.Module, folder: str | Path, dtype: torch.dtype,
                 keep: Callable[[str], bool] | None = None) -> None:
    """keep(name) False: the tensor belongs to a part of the model held elsewhere (a pipeline
    stage, advanced lesson 06) and is not read; every parameter of `model` must still be filled."""
    params = dict(model.named_parameters())
    tied = getattr(model, "lm_head", 0) is None
    filled: set[str] = set()
    stored_head = None
    for file, name, f in checkpoint_tensors(folder):
        if keep is not None and not keep(name):
            continue
        if tied and name == "lm_head.weight":
            stored_head = f.get_tensor(name)  # a tied checkpoint may still store it: check below
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} ({file}) matches no model parameter")
        if name in filled:
            raise KeyError(f"checkpoint tensor {name!r} appears twice")
        tensor = f.get_tensor(name)
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(dtype))
        filled.add(name)
    if stored_head is not None and not torch.equal(stored_head.to(dtype), params["model.embed_tokens.weight"]):
        raise ValueError("config says tie_word_embeddings but the checkpoint's lm_head.weight differs "
                         "from model.embed_tokens.weight")
    check_all_filled(params, filled, folder)


def load_model(folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> CausalLM:
    """config.json -> empty model in `dtype` -> weights. Returns the model in eval mode."""
    cfg = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    # Materialise parameters uninitialised (the loader fills them all) and build the RoPE tables.
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    load_weights(model, folder, dtype)
    return model.eval().requires_grad_(False)
