"""The numbers of a Qwen3-Next hybrid checkpoint, read from its config.json.

A hybrid stack has two kinds of token mixer, named per layer by `layer_types`:
  "full_attention"    softmax attention over every earlier token (a KV cache that grows);
  "linear_attention"  gated DeltaNet: a fixed-size state per sequence, updated token by token.
The attention layers keep everything lesson 04 read (heads, KV heads, head_dim, RoPE) plus two
Qwen3-Next touches: an output gate and RoPE on only part of each head (`partial_rotary_factor`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from step04_transformer.config import ModelConfig

ARCHITECTURE = "Qwen3NextForCausalLM"
FULL, LINEAR = "full_attention", "linear_attention"


@dataclass
class HybridConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0                 # RoPE turns the first rotary_dim dims of each head; the rest pass
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "HybridConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {str(folder)!r}")
        return cls.from_dict(json.loads(path.read_text()), Path(folder))

    @classmethod
    def from_dict(cls, cfg: dict, folder: Path | None = None) -> "HybridConfig":
        archs = cfg.get("architectures") or ([ARCHITECTURE] if cfg.get("model_type") == "qwen3_next" else [])
        if ARCHITECTURE not in archs:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; this lesson "
                             f"loads {ARCHITECTURE} checkpoints")
        if cfg.get("num_experts", 0) > 0 and len(cfg.get("mlp_only_layers") or []) < cfg["num_hidden_layers"]:
            raise NotImplementedError("this checkpoint has mixture-of-experts MLPs (num_experts > 0); this lesson "
                                      "runs the dense-MLP variant (num_experts=0); advanced lesson 12 teaches MoE")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        # Lesson 04's reader takes the shared fields; it knows Qwen3's switches, which fit here
        # (q/k-norm, no bias). RoPE's partial factor is ours to read.
        rope = dict(cfg.get("rope_parameters") or {})
        partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        base = ModelConfig.from_dict({**cfg, "architectures": ["Qwen3ForCausalLM"], "rope_parameters": rope,
                                      "attention_bias": False}, folder)
        types = tuple(cfg["layer_types"])
        if len(types) != base.num_layers or set(types) - {FULL, LINEAR}:
            raise ValueError(f"layer_types must name {base.num_layers} layers, each {FULL!r} or {LINEAR!r}; "
                             f"got {list(types)}")
        fields = {k: getattr(base, k) for k in ModelConfig.__dataclass_fields__}
        return cls(**{**fields, "architecture": ARCHITECTURE}, layer_types=types,
                   rotary_dim=int(base.head_dim * partial),
                   linear_num_key_heads=cfg["linear_num_key_heads"],
                   linear_num_value_heads=cfg["linear_num_value_heads"],
                   linear_key_head_dim=cfg["linear_key_head_dim"],
                   linear_value_head_dim=cfg["linear_value_head_dim"],
                   linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4))

    # ---- the two kinds of layer -------------------------------------------------------------
    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    def kv_config(self) -> ModelConfig:
        """The view a KV pool is built from (lessons 12-15): only the attention layers hold K/V."""
        return replace(ModelConfig(**{k: getattr(self, k) for k in ModelConfig.__dataclass_fields__}),
                       num_layers=len(self.attention_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_config().kv_bytes_per_token

    @property
    def conv_dim(self) -> int:
        """Channels the short convolution runs over: q, k and v of every linear head, side by side."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per linear layer and sequence: conv state [conv_dim, kernel - 1] (the last inputs the
        convolution still needs) and delta state [value heads, key dim, value dim]."""
        return ((self.conv_dim, self.linear_conv_kernel_dim - 1),
                (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim))
