"""One pipeline stage: lesson 04's model with only this stage's layers, loaded strictly.

    checkpoint tensor                  stage 0 (rank 0)            middle stages   last stage
    model.embed_tokens.weight          yes (and the LM head, tied)  -               -
    model.layers.{i}.*                 i in its range, on exactly one stage
    model.norm.weight                  -                            -               yes
    lm_head.weight (untied models)     yes                          -               -

The LM head lives on rank 0, not on the last stage: the last stage applies the final norm and
sends back only the normed hidden rows that will be sampled ([N, hidden] in the model's dtype:
for SmolLM2 in bf16, vocab x 4 / (hidden x 2) = 170x fewer bytes than float32 logits), and
rank 0 computes their logits with the matrix it holds anyway (a tied model's embedding).

The stage is built as the whole `CausalLM` on the meta device (no memory), then the layers
of other stages are swapped for `MissingLayer` placeholders with no weights (vLLM's
PPMissingLayer), so every parameter keeps its checkpoint name: `model.layers.12.mlp...` is
called that on the stage that holds layer 12. Each kept layer is renumbered from 0 inside
the stage, because the stage's KV pool has a slot only for its own layers.

Hidden state between stages: our decoder layer returns `x + mlp(norm(x))`, the residual
stream in one tensor, so one [T, hidden] tensor goes to the next stage. vLLM's layers keep
the residual apart (its fused add+RMSNorm kernel adds the residual and normalises in one
pass, and returns both), so its stages send two tensors, `hidden_states` and `residual`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from step04_transformer.config import ModelConfig
from step04_transformer.loader import load_weights
from step04_transformer.model import CausalLM, StepAttention

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Stage:
    index: int
    num_stages: int
    start: int          # first layer it runs
    end: int            # one past its last layer

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


class MissingLayer(nn.Module):
    """Stands where another stage's layer is: no weights, never called."""

    def forward(self, *args):
        raise RuntimeError("this layer belongs to another pipeline stage")


class DtypeProbe(nn.Module):
    """Where a middle stage's embedding would be: no weights, but `.weight` tells the dtype and
    device, which the model transforms of lessons 14 and 16 read from `model.model.embed_tokens.weight`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("weight", torch.empty(0, cfg.hidden_size), persistent=False)

    def forward(self, *args):
        raise RuntimeError("only the first pipeline stage embeds tokens")


def keep_stage_only(model: CausalLM, cfg: ModelConfig, stage: Stage) -> None:
    """Swap out (on the meta device, before anything is allocated) what other stages hold."""
    model.stage = stage
    for i in range(cfg.num_layers):
        if stage.start <= i < stage.end:
            model.model.layers[i].self_attn.layer_idx = i - stage.start
        else:
            model.model.layers[i] = MissingLayer()
    if not stage.is_first:                # the embedding and the LM head stay on rank 0
        model.model.embed_tokens, model.lm_head = DtypeProbe(cfg), None
    if not stage.is_last:
        model.model.norm = None


class StageModel(CausalLM):
    def __init__(self, cfg: ModelConfig, stage: Stage):
        super().__init__(cfg)                # on the meta device: nothing is allocated yet
        keep_stage_only(self, cfg, stage)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: StepAttention,
                hidden: Tensor | None = None) -> Tensor:
        """Stage 0: token ids -> hidden; others: the previous stage's hidden -> hidden. The last
        stage returns the final-normed hidden states, for stage 0's compute_logits."""
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids) if self.stage.is_first else hidden
        for i in range(self.stage.start, self.stage.end):
            x = self.model.layers[i](x, cos, sin, attn)
        return self.model.norm(x) if self.stage.is_last else x


def stage_config(cfg: ModelConfig, stage: Stage) -> ModelConfig:
    """The config the stage's KV pool is sized from: only its layers."""
    return dataclasses.replace(cfg, num_layers=stage.num_layers)


def owned_by(name: str, cfg: ModelConfig, stage: Stage) -> bool:
    """Does checkpoint tensor `name` belong to this stage? Unknown names are the loader's error."""
    m = _LAYER.match(name)
    if m:
        return stage.start <= int(m.group(1)) < stage.end
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return stage.is_first
    if name == "model.norm.weight":
        return stage.is_last
    return True          # not a known tensor of any stage: let the strict loader name it


def load_stage(folder: str | Path, stage: Stage, dtype: torch.dtype = torch.float32) -> StageModel:
    """Lesson 04's load_model for one stage: reads only the tensors the stage owns, and still
    fails naming the tensor on anything that does not line up (missing, unexpected, wrong shape)."""
    cfg = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = StageModel(cfg, stage)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    load_weights(model, folder, dtype, keep=lambda name: owned_by(name, cfg, stage))
    return model.eval().requires_grad_(False)
