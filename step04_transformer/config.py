"""The few numbers that define a Qwen3 / Qwen2 / Llama checkpoint, read from its config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture -> (q/k-norm, q/k/v bias). These two switches are the whole difference.
ARCHITECTURES = {
    "Qwen3ForCausalLM": (True, False),
    "Qwen2ForCausalLM": (False, True),
    "LlamaForCausalLM": (False, None),  # None: read `attention_bias` from the config
}
# Fallback when config.json names no architecture (e.g. one converted from GGUF).
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {str(folder)!r}")
        cfg = json.loads(path.read_text())
        return cls.from_dict(cfg, folder)

    @classmethod
    def from_dict(cls, cfg: dict, folder: Path | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {sorted(ARCHITECTURES)}")
        qk_norm, bias = ARCHITECTURES[arch]
        if bias is None:
            bias = bool(cfg.get("attention_bias", False))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only 'default')")
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            attention_bias=bias,
            eos_token_ids=_eos_ids(cfg, folder),
            bos_token_id=cfg.get("bos_token_id"),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bf16: what a KV cache pays per token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def _eos_ids(cfg: dict, folder: Path | None) -> list[int]:
    """EOS ids from config.json, widened by generation_config.json (chat models stop on several)."""
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    gen = folder / "generation_config.json" if folder else None
    if gen is not None and gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        for i in (s if isinstance(s, list) else [s]):
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids
