"""The numbers a Qwen3-MoE checkpoint adds to a dense Qwen3's, read from the same config.json.

Qwen3-MoE's attention is Qwen3's (q/k-norm, no q/k/v bias), so lesson 04's `ModelConfig` reads
everything but the MLP; this dataclass adds the mixture-of-experts fields:

    num_experts            E experts per sparse layer ("num_experts", or "num_local_experts"
                           as transformers 5 writes it)
    num_experts_per_tok    k: each token goes to its k best experts
    moe_intermediate_size  the inner size of one expert's SwiGLU (much smaller than a dense MLP's)
    norm_topk_prob         rescale the k chosen probabilities to sum to 1 (Qwen3-MoE: true)
    decoder_sparse_step    layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers        ... and i is not in this list (those keep a dense MLP of
                           intermediate_size); the rule is transformers' Qwen3MoeDecoderLayer's
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from step04_transformer.config import ModelConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"


@dataclass
class MoEConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "MoEConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {str(folder)!r}")
        return cls.from_dict(json.loads(path.read_text()), Path(folder))

    @classmethod
    def from_dict(cls, cfg: dict, folder: Path | None = None) -> "MoEConfig":
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs and cfg.get("model_type") != "qwen3_moe":
            raise ValueError(f"not a Qwen3-MoE checkpoint: architectures {archs}, model_type "
                             f"{cfg.get('model_type')!r} (this lesson loads {ARCHITECTURE})")
        # The attention half is Qwen3's: let lesson 04 read it under that name.
        dense = ModelConfig.from_dict({**cfg, "architectures": ["Qwen3ForCausalLM"]}, folder)
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        k = cfg.get("num_experts_per_tok")
        if not experts or not k or not cfg.get("moe_intermediate_size"):
            raise ValueError("config.json lacks num_experts / num_experts_per_tok / moe_intermediate_size")
        if not 1 <= k <= experts:
            raise ValueError(f"num_experts_per_tok={k} must be in 1..num_experts={experts}")
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(ModelConfig)}
        return cls(**{**fields, "architecture": ARCHITECTURE}, num_experts=int(experts), num_experts_per_tok=int(k),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), decoder_sparse_step=step,
                   mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []])

    def is_sparse(self, layer: int) -> bool:
        """Does layer `layer` hold experts (else a dense SwiGLU)? transformers' rule."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse(i)]
