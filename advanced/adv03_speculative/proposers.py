"""Who guesses the next k tokens: prompt lookup (n-gram) and a draft made of the target's first layers.

A proposer is asked, once per engine step, for up to k_i draft tokens for each decoding
sequence i. It returns, per sequence, the tokens and the distribution q each one was drawn
from (None when the proposal is deterministic: q is then a point mass on the token). The
engine has already scheduled 1 + k_i slots per sequence, so the KV blocks for the positions
the drafts will occupy exist when `propose` runs; a draft model may write its own K/V there.

    NgramProposer       no model at all: find the last n tokens earlier in prompt + output
                        and propose the tokens that followed them (prompt lookup decoding).
    LayerSkipProposer   the target's first L' layers + its final norm + its LM head
                        (self-speculative decoding). Its K/V for those layers are exactly
                        the target's, so it reads and writes the target's own KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from step06_sampler.sampler import exponential_race
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]
    probs: Tensor | None = None   # [len(tokens), V]: q_i, the distribution token i was drawn from;
                                  # None: a deterministic proposal (q_i is a point mass on tokens[i])


class Proposer(Protocol):
    def propose(self, engine, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """At most ks[i] draft tokens for seqs[i], which is decoding: its last token is not in
        the KV cache yet, and blocks exist for positions up to num_computed_tokens + ks[i]."""
        ...


# ---- prompt lookup --------------------------------------------------------------------------
def prompt_lookup(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens.

    Tries the longest suffix first (n = max_n down to min_n): a longer match is a better
    predictor. The most recent occurrence is taken because text that is being copied (code
    under edit, a quoted passage) was usually seen last where the copy is going on.
    """
    L = len(tokens)
    if k < 1 or L < 2:
        return []
    t = torch.tensor(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # Every n-gram that ends before the last token: starts 0 .. L-n-1 (not the suffix itself),
        # so at least one token always follows a match.
        windows = t[:L - 1].unfold(0, n, 1)
        hits = (windows == t[L - n:]).all(dim=1).nonzero()
        if len(hits):
            i = int(hits[-1])
            return tokens[i + n:i + n + k]
    return []


@dataclass
class NgramProposer:
    """Prompt lookup decoding: proposals copied from the sequence itself (q is a point mass)."""
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, engine, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(prompt_lookup(s.token_ids, k, self.min_n, self.max_n)) for s, k in zip(seqs, ks)]


# ---- a draft made of the target's first layers ----------------------------------------------
@dataclass
class DraftSlot:
    """What a step attention reads of a sequence (lessons 12-16): where its K/V live and
    how many tokens are already there. One per sequence, advanced by one token per draft step."""
    block_table: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


def draft_forward(model, num_layers: int, input_ids: Tensor, positions: Tensor, attn) -> Tensor:
    """Lesson 04's forward cut after `num_layers` layers: [T] -> normed hidden states [T, hidden]."""
    cos, sin = model.rotary(positions)
    x = model.model.embed_tokens(input_ids)
    for layer in model.model.layers[:num_layers]:
        x = layer(x, cos, sin, attn)
    return model.model.norm(x)


@dataclass
class LayerSkipProposer:
    """The target's first `num_layers` layers, its final norm and its LM head, run k times.

    Why no KV of its own: layer l's K/V at position p depend only on tokens 0..p and on
    layers 0..l, and those layers are the target's. So for l < num_layers the draft's K/V
    are the target's K/V: it attends over what the target wrote for the context, and writes
    its draft tokens into the slots the verification will write next. The verification
    forward writes every new token's K/V before attending, so the target never reads what
    the draft wrote; rejected positions are rolled back with the target's.
    """
    num_layers: int
    forwards: int = field(default=0, init=False)      # draft forwards run (each over all sequences)

    def propose(self, engine, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        model = engine.model
        if not 0 < self.num_layers <= len(model.model.layers):
            raise ValueError(f"num_layers must be in [1, {len(model.model.layers)}], got {self.num_layers}")
        slots = [DraftSlot(s.block_table, s.num_computed_tokens, s.num_prompt_tokens) for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        qs: list[list[Tensor]] = [[] for _ in seqs]
        for j in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > j]
            # Step j feeds the token at position c + j: the sequence's last token, then the drafts.
            ids = [tokens[i][-1] if j else seqs[i].token_ids[-1] for i in active]
            pos = [seqs[i].num_computed_tokens + j for i in active]
            for i, p in zip(active, pos):
                slots[i].num_computed_tokens = p
            batch = ScheduledBatch([slots[i] for i in active], [1] * len(active))
            hidden = draft_forward(model, self.num_layers, torch.tensor(ids), torch.tensor(pos),
                                   engine.make_attention(batch))
            self.forwards += 1
            logits = engine.compute_logits(hidden)
            picked = logits.argmax(dim=-1)                   # greedy requests: the draft's argmax
            rows = [r for r, i in enumerate(active) if not seqs[i].params.greedy]
            if rows:
                # Sampled requests draw from q = the draft's distribution under the request's own
                # temperature / top-k / top-p / min-p, and keep q for the rejection test.
                q = engine.sampler.probs(logits[rows], [seqs[active[r]].params for r in rows])
                drawn = exponential_race(q, [seqs[active[r]].generator for r in rows])
                picked[rows] = drawn
                for r, row in zip(rows, q):
                    qs[active[r]].append(row)
            for r, i in enumerate(active):
                tokens[i].append(int(picked[r]))
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]
