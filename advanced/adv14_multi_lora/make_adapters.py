"""Adapters for the lesson's run: PEFT folders written with peft on the spot.

No fine-tuned LoRA of SmolLM2 or Qwen3 can be downloaded here, so these are made, not trained:
peft's LoraConfig + get_peft_model + save_pretrained write one folder per shape (rank, target
modules), with lora_B drawn at random (peft starts it at zero: an untrained adapter changes
nothing); further adapters of the same shape are those folders with A and B drawn again from a
fixed seed. What they say is noise around the base model; what they cost is what real ones of
the same ranks and targets cost.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# (rank, target modules): an attention-only adapter of rank 8 and an everywhere one of rank 16.
SHAPES = [(8, ["q_proj", "v_proj"]),
          (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])]


def peft_template(base, out: Path, rank: int, targets: list[str], seed: int, b_std: float):
    """One adapter folder from peft itself (its config, its tensor names and shapes), made on
    `base` (a transformers model, or its folder); returns the base model again, LoRA layers removed."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if isinstance(base, (str, Path)):
        base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    peft_model.save_pretrained(out)
    return peft_model.unload()


def redraw(template: Path, out: Path, seed: int, b_std: float) -> Path:
    """A copy of `template` with every A and B drawn again (A as peft draws it: uniform, 1/sqrt(in))."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(template / "adapter_config.json", out / "adapter_config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in sorted(load_file(template / "adapter_model.safetensors").items()):
        if ".lora_A." in name:
            bound = t.shape[1] ** -0.5
            tensors[name] = (torch.rand(t.shape, generator=gen) * 2 - 1) * bound
        else:
            tensors[name] = torch.randn(t.shape, generator=gen) * b_std
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


def make_adapters(base_dir: Path, root: Path, count: int, seed: int = 0, b_std: float = 0.02) -> list[Path]:
    """`count` adapter folders under root, alternating SHAPES: adapter-00, adapter-01, ..."""
    base, templates = base_dir, []
    for i, (r, t) in enumerate(SHAPES):                     # one load of the base model for both
        templates.append(root / f"template-r{r}")
        base = peft_template(base, templates[-1], r, t, seed + i, b_std)
    folders = []
    for i in range(count):
        folder = root / f"adapter-{i:02d}"
        folders.append(redraw(templates[i % len(templates)], folder, seed + 100 + i, b_std))
    return folders


def describe(folder: Path, base_params: int) -> str:
    """'r=16, alpha=32, q_proj/..., 4.88 M numbers (3.6% of the base)': counted from the file."""
    config = json.loads((folder / "adapter_config.json").read_text())
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        count = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return (f"r={config['r']}, alpha={config['lora_alpha']}, {'/'.join(sorted(config['target_modules']))}: "
            f"{count / 1e6:.2f} M numbers, {100 * count / base_params:.1f}% of the base")
