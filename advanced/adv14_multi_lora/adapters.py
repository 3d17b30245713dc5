"""LoRA adapters as PEFT saves them, read and checked against the base model.

A PEFT LoRA folder holds two files:

    adapter_config.json        r, lora_alpha, target_modules, use_rslora, base_model_name_or_path ...
    adapter_model.safetensors  base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight  [r, in]
                               base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_B.weight  [out, r]

and stands for W' = W + scaling * B @ A on each targeted linear, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA). The engine never forms W': it computes x W^T + ((x A^T) B^T)
scaling, so one base weight serves every adapter. scaling is folded into B here, once.

A folder that does not fit the model (a missing file, a module this engine does not adapt, a
shape of another model, a PEFT option changing the maths) is refused with the reason, before
any request uses it: a LoRA that silently loads half its weights still produces fluent text.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

# The linears of a Qwen3 / Llama decoder layer an adapter may target, and their parent module.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: a name for the adapter, a positive integer id, its PEFT folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)):
            raise TypeError(f"LoRARequest.lora_path must be a folder path, got {type(self.lora_path).__name__}")
        object.__setattr__(self, "lora_path", str(self.lora_path))


Key = tuple[int, str]          # (layer index, module name), e.g. (0, "q_proj")


@dataclass
class LoRAAdapter:
    """One adapter's weights in the model's dtype: per targeted linear, A [r, in] and B^T * scaling [r, out]."""
    name: str
    rank: int
    scaling: float
    weights: dict[Key, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _fail(request: LoRARequest, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {what}")


def read_config(request: LoRARequest) -> dict:
    """adapter_config.json, with every PEFT option this engine does not compute refused by name."""
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: {folder} is not a folder")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: no {CONFIG_FILE} in {folder}")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise _fail(request, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(request, f"peft_type is {config['peft_type']!r}; only LORA adapters are served")
    unsupported = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
                   "alpha_pattern": {}, "layer_replication": None, "fan_in_fan_out": False}
    for key, plain in unsupported.items():
        if config.get(key, plain) not in (plain, None, {}, [], False):
            raise _fail(request, f"{key}={config[key]!r} in {CONFIG_FILE} is not supported here (only plain LoRA "
                                 f"on linears: {key} must be {plain!r})")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise _fail(request, f"target_modules must be a list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise _fail(request, f"target_modules {unknown} are not adapted by this engine "
                             f"(it adapts {', '.join(TARGET_MODULES)})")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise _fail(request, f"r must be an integer >= 1, got {config.get('r')!r}")
    return config


def load_adapter(request: LoRARequest, shapes: dict[str, tuple[int, int]], num_layers: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter's tensors, checked against the base: shapes {module: (in, out)}, num_layers."""
    config = read_config(request)
    path = Path(request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        other = [p.name for p in Path(request.lora_path).glob("adapter_model.*")]
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: no {WEIGHTS_FILE} in {request.lora_path}"
                                + (f" (found {other}: save it with safe_serialization=True)" if other else ""))
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    base = config.get("base_model_name_or_path")
    made_for = f" (made for {base!r}?)" if base else ""
    halves: dict[Key, dict[str, Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            m = _TENSOR_NAME.fullmatch(name)
            if m is None or m.group(3) not in TARGET_MODULES or TARGET_MODULES[m.group(3)] != m.group(2):
                raise _fail(request, f"tensor {name!r} is not the LoRA A or B of a decoder layer's "
                                     f"{'/'.join(TARGET_MODULES)}")
            layer, module, half = int(m.group(1)), m.group(3), m.group(4)
            if module not in config["target_modules"]:
                raise _fail(request, f"tensor {name!r} adapts {module}, which target_modules does not list")
            if layer >= num_layers:
                raise _fail(request, f"tensor {name!r} adapts layer {layer}; the base model has {num_layers} "
                                     f"layers{made_for}")
            halves.setdefault((layer, module), {})[half] = f.get_tensor(name)
    if not halves:
        raise _fail(request, f"{WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoRAAdapter(request.lora_name, r, scaling)
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{where} has lora_{''.join(pair)} but not its partner")
        a, b = pair["A"], pair["B"]
        n_in, n_out = shapes[module]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise _fail(request, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                 f"r={r} and the base model's {module} ({n_in} in, {n_out} out){made_for}")
        # B^T with the scaling folded in, in float32 first so the product is rounded once.
        adapter.weights[(layer, module)] = (a.to(dtype), (b.float().t() * scaling).to(dtype).contiguous())
    return adapter
