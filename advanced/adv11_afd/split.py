"""Each decoder layer cut in two: the attention half and the FFN half, and who loads which weights.

    lesson 04's DecoderLayer.forward           attention side (rank 0)       FFN side (ranks 1..)
    h = x + self_attn(input_layernorm(x))      input_layernorm, q/k/v/o,     -
                                               q/k norms, the KV cache
    out = h + mlp(post_attention_layernorm(h)) -                             post_attention_layernorm,
                                                                             gate/up/down
    also: embedding, final norm, LM head       yes                           -

The two halves are the two lines of lesson 04's layer, called one at a time, so the numbers are
the same as the whole layer's: only where they run changes. Between them one tensor, `h`
[T, hidden], crosses to the FFN side, and one, `out` [T, hidden], comes back.

Both sides are built as lesson 04's whole `CausalLM` on the meta device (no memory), with the
other side's modules swapped for weightless placeholders (`OnTheOtherSide`; adv06's `DtypeProbe`),
so every parameter keeps its checkpoint name; lesson 04's strict loader, given a `keep` filter,
reads only the side's tensors and still names any tensor that is missing or mis-shaped.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from step04_transformer.config import ModelConfig
from step04_transformer.loader import load_weights
from step04_transformer.model import CausalLM, DecoderLayer, StepAttention
from advanced.adv06_pipeline_parallel.stage import DtypeProbe

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)$")
FFN_PARTS = ("post_attention_layernorm.", "mlp.")       # a layer's tensors the FFN side owns


def is_ffn_tensor(name: str) -> bool:
    """Does checkpoint tensor `name` belong to the FFN side? Everything else is the attention side's."""
    m = _LAYER.match(name)
    return bool(m) and m.group(1).startswith(FFN_PARTS)


class OnTheOtherSide(nn.Module):
    """Stands where the other side's module is (adv06's MissingLayer, for a side): no weights, never called."""

    def __init__(self, side: str):
        super().__init__()
        self.side = side

    def forward(self, *args):
        raise RuntimeError(f"this module runs on the {self.side} side, in another process")


def attention_half(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, attn: StepAttention) -> Tensor:
    """The first line of lesson 04's DecoderLayer.forward: x + attention(norm(x)), KV written to the pool."""
    return x + layer.self_attn(layer.input_layernorm(x), cos, sin, attn)


def ffn_half(layer: DecoderLayer, h: Tensor) -> Tensor:
    """The second line: h + mlp(norm(h))."""
    return h + layer.mlp(layer.post_attention_layernorm(h))


class AttentionSide(CausalLM):
    """Lesson 04's model without any layer's MLP or post-attention norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)                        # on the meta device: nothing is allocated yet
        for layer in self.model.layers:
            layer.post_attention_layernorm, layer.mlp = OnTheOtherSide("FFN"), OnTheOtherSide("FFN")

    def forward(self, *args):
        raise RuntimeError("the attention side runs layer halves (AFDRunner), never the whole model")


class FFNSide(CausalLM):
    """Lesson 04's model with only each layer's post-attention norm and MLP: no embedding, no
    attention, no final norm, no LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for layer in self.model.layers:
            layer.input_layernorm, layer.self_attn = OnTheOtherSide("attention"), OnTheOtherSide("attention")
        self.model.embed_tokens, self.model.norm, self.lm_head = DtypeProbe(cfg), None, None

    def forward(self, layer_idx: int, h: Tensor) -> Tensor:
        return ffn_half(self.model.layers[layer_idx], h)


def _load(cls: type, folder: str | Path, dtype: torch.dtype, keep) -> CausalLM:
    cfg = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    load_weights(model, folder, dtype, keep=keep)
    return model.eval().requires_grad_(False)


def load_attention_side(folder: str | Path, dtype: torch.dtype = torch.float32) -> AttentionSide:
    return _load(AttentionSide, folder, dtype, lambda name: not is_ffn_tensor(name))


def load_ffn_side(folder: str | Path, dtype: torch.dtype = torch.float32) -> FFNSide:
    return _load(FFNSide, folder, dtype, is_ffn_tensor)
