"""Token embedding and the tied LM head.

An embedding is a lookup table E of shape [vocab_size, hidden_size]: token id t becomes
row E[t]. At the other end of the model, the LM head turns a hidden vector h back into one
score (logit) per vocabulary entry. A model with *tied* embeddings (Qwen3-0.6B, SmolLM2,
Llama-3.2-1B, ...) does not store a second matrix for that: it reuses E, so

    logits = h @ E^T        # [.., hidden] @ [hidden, vocab] -> [.., vocab]

Row t of E is both "what token t means on the way in" and "what a hidden state must look
like for token t to score high on the way out".
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

EMBED_NAME = "model.embed_tokens.weight"  # the Hugging Face name in Llama/Qwen2/Qwen3 checkpoints


class TokenEmbedding(torch.nn.Module):
    """A [vocab_size, hidden_size] table; forward(ids) returns the rows for those ids."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)  # placeholder; real weights are loaded

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "TokenEmbedding":
        emb = cls(weight.shape[0], weight.shape[1], dtype=weight.dtype)
        with torch.no_grad():
            emb.weight.copy_(weight)
        return emb

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: any shape of integer token ids -> output: ids.shape + [hidden_size]
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}")
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ((ids < 0) | (ids >= self.vocab_size)).nonzero()[0]
            raise IndexError(
                f"token id {int(ids[tuple(bad)])} at position {tuple(bad.tolist())} is out of "
                f"range for an embedding with vocab_size {self.vocab_size} (valid: 0..{self.vocab_size - 1})"
            )
        # The whole lesson in one line: pick rows. (Same as F.embedding(ids, self.weight),
        # and the same as one_hot(ids) @ weight, without building the one-hot matrix.)
        return self.weight[ids]


def tied_lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits of a tied model: hidden [.., H] @ weight^T [H, V] -> [.., V].

    Logit j is the dot product of the hidden vector with embedding row j."""
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match embedding width {weight.shape[1]}")
    return F.linear(hidden, weight)  # = hidden @ weight.T, the way nn.Linear(bias=False) computes it


def _find_embedding(model_dir: Path) -> tuple[Path, str]:
    """(file, tensor name) of the token embedding, reading only safetensors headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # sharded checkpoint: the index says which file holds each tensor
        weight_map = json.loads(index.read_text())["weight_map"]
        names = {name: model_dir / file for name, file in weight_map.items()}
    else:
        names = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                names.update({name: file for name in f.keys()})
    if EMBED_NAME in names:
        return names[EMBED_NAME], EMBED_NAME
    # other prefixes, e.g. "model.language_model.embed_tokens.weight" in multimodal wrappers
    others = sorted(n for n in names if n.endswith("embed_tokens.weight"))
    if others:
        return names[others[0]], others[0]
    raise KeyError(f"no '*embed_tokens.weight' tensor in the safetensors files of {model_dir}")


def load_embedding(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Read just the embedding matrix [vocab, hidden] from a checkpoint folder.

    safe_open maps the file and reads only this tensor's bytes; the other ~270 tensors
    of the model are never touched."""
    file, name = _find_embedding(Path(model_dir))
    with safe_open(str(file), framework="pt") as f:
        weight = f.get_tensor(name)
    return weight.to(dtype)


def nearest_neighbours(weight: torch.Tensor, token_id: int, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The k rows most similar to row `token_id` by cosine similarity, best first.

    Returns (ids [k], cosine similarities [k]). The token itself is included: it is its own
    nearest neighbour with cosine 1 (unless another row is an exact multiple of it)."""
    if not 0 <= token_id < weight.shape[0]:
        raise IndexError(f"token id {token_id} is out of range for vocab_size {weight.shape[0]}")
    unit = F.normalize(weight.float(), dim=-1)  # every row scaled to length 1
    sims = unit @ unit[token_id]                # [vocab]: cos(angle) between row t and every row
    top = torch.topk(sims, k)
    return top.indices, top.values
