"""A pipeline stage whose layers are split over a tensor-parallel group: TP x PP.

    --tensor-parallel-size 2 --pipeline-parallel-size 2, 4 ranks (rank = stage x tp + tp rank)

         stage 0 (node 0)                          stage 1 (node 1)
      rank 0            rank 1                  rank 2            rank 3
      layers 0..k-1, each split in two          layers k..n-1, each split in two
      <-- all-reduce -->                        <-- all-reduce -->       (inside a node: fast)
      hidden ===================================> rank 2                 (across nodes: one
                        hidden =================================> rank 3  hidden per micro-batch)
      LM head, sample <========= normed rows (rank 2 only) ========

vLLM's placement rule (lesson 17's launch.placement): a TP group stays on one machine, where
its two all-reduces per layer are cheap, and only the pipeline's hidden states cross machines.

Each rank of stage s sends its whole hidden state to the rank with the same TP rank in stage
s + 1: after the row-parallel all-reduce every rank of a stage holds the same [T, hidden], so
this sends tp copies of it. vLLM sends 1/tp of it from each and all-gathers on the far side (tp
times fewer bytes between machines, one more collective inside); this lesson keeps the copy.

The embedding and the LM head are not split here: every rank of stage 0 holds the whole
embedding (each embeds the step's tokens itself, no all-reduce) and rank 0 alone runs the LM
head on the rows the last stage sends back, exactly as in the pipeline without TP. It costs
(tp - 1) x vocab x hidden of memory on stage 0; lesson 17's VocabParallelEmbedding would save
it at the price of an all-reduce per step and the rows sent to every rank of stage 0.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from step04_transformer.config import ModelConfig
from step17_tensor_parallel import parallel
from step17_tensor_parallel.loader import load_sharded
from step17_tensor_parallel.model import TPCausalLM
from advanced.adv06_pipeline_parallel.stage import Stage, StageModel, keep_stage_only, owned_by


class TPStageModel(TPCausalLM):
    def __init__(self, cfg: ModelConfig, stage: Stage, tp_rank: int, tp: int):
        super().__init__(cfg, tp_rank, tp)          # lesson 17's split layers, on the meta device
        keep_stage_only(self, cfg, stage)
        if stage.is_first:                           # whole, not split: see the module's comment
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            untied_head = not cfg.tie_word_embeddings and tp_rank == 0
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied_head else None

    forward = StageModel.forward                     # the same stage forward: embed or receive, layers, norm

    def compute_logits(self, hidden):
        """Rank 0 only: lesson 04's LM head on the whole vocabulary."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (hidden @ weight.t()).float()


def load_tp_stage(folder: str | Path, stage: Stage, tp_rank: int, tp: int,
                  dtype: torch.dtype = torch.float32) -> TPStageModel:
    """Lesson 17's sharded strict loader, reading only this stage's tensors."""
    cfg = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = TPStageModel(cfg, stage, tp_rank, tp)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def keep(name: str) -> bool:
        if name == "lm_head.weight" and not cfg.tie_word_embeddings:
            return stage.is_first and tp_rank == 0
        return owned_by(name, cfg, stage)
    with torch.no_grad():
        load_sharded(model, folder, keep)
    return model.eval().requires_grad_(False)


def stage_ranks(stage: int, tp: int) -> list[int]:
    return [stage * tp + r for r in range(tp)]


def join_tp_groups(pp: int, tp: int, rank: int, timeout_s: float) -> None:
    """Every rank creates every stage's group, in the same order (torch.distributed's rule for
    new_group), then routes its layers' all-reduces through its own stage's group."""
    mine = None
    for s in range(pp):
        group = dist.new_group(stage_ranks(s, tp), timeout=datetime.timedelta(seconds=timeout_s))
        if rank in stage_ranks(s, tp):
            mine = group
    parallel.use_tp_group(mine)
