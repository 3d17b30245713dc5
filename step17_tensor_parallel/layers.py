"""The four parallel layers. Each holds only its rank's slice of the weight, knows which slice
that is (to load it), and says where the ranks must talk.

    ColumnParallelLinear    W split by output rows:  y_r = x W_r^T     every rank has x, gets y's
                            slice r. No communication: q/k/v and gate/up end here, and what
                            follows (attention per head, silu(gate) * up) works slice by slice.
    RowParallelLinear       W split by input columns: y = sum_r x_r W_r^T   each rank has the
                            slice x_r the column layer left it and adds one partial of the
                            full output: one all-reduce. o_proj and down_proj.
    VocabParallelEmbedding  the table split by token id: a rank looks up the ids it owns, writes
                            zeros for the others, and an all-reduce fills in every row.
    ParallelLMHead          the same split for the logits: each rank scores its part of the
                            vocabulary, rank 0 gathers the parts (it is the one that samples).

Each linear keeps a plain `nn.Linear` inside, so lesson 14's `pack_linears` packs it for oneDNN
like any other; the layer adds the slicing and the collective around it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from step17_tensor_parallel.parallel import all_reduce, gather_to_rank0


def _check_full_shape(name: str, got, expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(got)}, model (unsharded) {expected}")


class ColumnParallelLinear(nn.Module):
    """Output features split over `num_shards` slices (default: one per rank).

    num_shards < world replicates: with 2 KV heads and 4 ranks, ranks 0-1 hold KV head 0 and
    ranks 2-3 KV head 1, as vLLM does when there are fewer KV heads than ranks.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, world: int,
                 num_shards: int | None = None):
        super().__init__()
        num_shards = num_shards or world
        self.shard = rank * num_shards // world
        self.rows = out_features // num_shards           # divisibility checked before (model.py)
        self.full_shape = (out_features, in_features)
        self.linear = nn.Linear(in_features, self.rows, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)

    def load_shard(self, name: str, attr: str, tensor_slice) -> str:
        """Copy this rank's rows of checkpoint tensor `name` (a safetensors slice: reads only them)."""
        _check_full_shape(name, tensor_slice.get_shape(), self.full_shape[:1 if attr == "bias" else 2])
        lo = self.shard * self.rows
        getattr(self.linear, attr).copy_(tensor_slice[lo:lo + self.rows])
        return f"linear.{attr}"


class RowParallelLinear(nn.Module):
    """Input features split by rank; the partial outputs are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world
        self.cols = in_features // world
        self.full_shape = (out_features, in_features)
        self.linear = nn.Linear(self.cols, out_features, bias=False)
        # A bias is added once, after the sum (on every rank: they all hold the same sum).
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        if self.world > 1:
            all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load_shard(self, name: str, attr: str, tensor_slice) -> str:
        if attr == "bias":
            _check_full_shape(name, tensor_slice.get_shape(), self.full_shape[:1])
            self.bias.copy_(tensor_slice[:])
            return "bias"
        _check_full_shape(name, tensor_slice.get_shape(), self.full_shape)
        lo = self.rank * self.cols
        self.linear.weight.copy_(tensor_slice[:, lo:lo + self.cols])
        return "linear.weight"


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first id, end id, rows per rank): ceil(vocab / world) rows each, the last rank's tail
    padded with zero rows, so any vocabulary size splits (vLLM pads the same way)."""
    per = -(-vocab // world)
    start = min(rank * per, vocab)
    return start, min(start + per, vocab), per


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, world: int):
        super().__init__()
        self.vocab, self.world = vocab, world
        self.start, self.end, per = vocab_range(vocab, rank, world)
        self.weight = nn.Parameter(torch.empty(per, hidden))

    def forward(self, ids: Tensor) -> Tensor:
        if self.world == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mine, self.weight)   # ids owned elsewhere -> row 0 ...
        out.mul_(mine[:, None].to(out.dtype))                         # ... then zeroed
        return all_reduce(out)      # exactly one rank contributed each row: the sum is that row

    def load_shard(self, name: str, attr: str, tensor_slice) -> str:
        _check_full_shape(name, tensor_slice.get_shape(), (self.vocab, self.weight.shape[1]))
        n = self.end - self.start
        self.weight[:n].copy_(tensor_slice[self.start:self.end])
        self.weight[n:].zero_()
        return "weight"


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows; rank 0 gathers the full [N, vocab], float32."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool):
        super().__init__()
        self.vocab, self.world = embedding.vocab, embedding.world
        self.start, self.end = embedding.start, embedding.end
        per, hidden = embedding.weight.shape
        self.linear = nn.Linear(hidden, per, bias=False)
        if tied:
            self.linear.weight = embedding.weight       # the same tensor, not a copy

    def forward(self, hidden: Tensor) -> Tensor | None:
        local = self.linear(hidden).float()
        if self.world == 1:
            return local[:, :self.vocab]
        parts = gather_to_rank0(local, self.world)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.vocab]

    def load_shard(self, name: str, attr: str, tensor_slice) -> str:
        _check_full_shape(name, tensor_slice.get_shape(), (self.vocab, self.linear.weight.shape[1]))
        n = self.end - self.start
        self.linear.weight[:n].copy_(tensor_slice[self.start:self.end])
        self.linear.weight[n:].zero_()
        return "linear.weight"
