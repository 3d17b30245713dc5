"""Verification: which draft tokens the target keeps, and the one token it adds.

For a sequence with drafts x_1..x_k the target forward gives k + 1 rows of logits: row i is
the target's distribution p_i for the token after x_1..x_i (row 0: after the last accepted
token). Left to right:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    on the first rejection: emit one token from norm(max(0, p_i - q_i)) and stop
    if all k are accepted: emit a bonus token from p_k

Every step emits between 1 and k + 1 tokens, and each is distributed exactly as if the
target had sampled it alone (README: the proof). Two special cases:
  - q a point mass (prompt lookup: the draft is a fact, not a draw): accept with probability
    p_i(x_i); the residual max(0, p_i - q_i) is p_i with x_i removed.
  - greedy requests: p_i is a point mass on the target's argmax, so "accept" means "the
    target's argmax is the draft", and the emitted token is the argmax where they differ.
"""
from __future__ import annotations

import torch
from torch import Tensor

from step06_sampler.sampler import Sampler, exponential_race
from step09_continuous_batching.sequence import Sequence

from .proposers import Draft


def verify_greedy(argmax: list[int], draft: list[int]) -> tuple[list[int], int]:
    """argmax: the target's choice at each of the len(draft) + 1 rows. Returns (tokens, accepted)."""
    for i, x in enumerate(draft):
        if argmax[i] != x:
            return draft[:i] + [argmax[i]], i
    return draft + [argmax[len(draft)]], len(draft)


def rejection_sample(p: Tensor, draft: list[int], q: Tensor | None,
                     generator: torch.Generator | None) -> tuple[list[int], int]:
    """p: [k + 1, V] target probabilities; q: [k, V] draft probabilities or None (point masses).
    Returns (tokens, accepted): the accepted drafts and one token from the residual or the bonus row."""
    k = len(draft)
    accepted = k
    if k:
        x = torch.tensor(draft)
        rows = torch.arange(k)
        px = p[rows, x]
        qx = torch.ones(k) if q is None else q[rows, x]
        u = torch.rand(k, generator=generator)
        # u < p/q, written without the division: q(x) > 0 because x was drawn from q.
        rejected = (u * qx >= px).nonzero()
        if len(rejected):
            accepted = int(rejected[0])
    if accepted == k:
        last = p[k]                                             # all accepted: the bonus token
    else:
        i = accepted
        if q is None:
            last = p[i].clone()
            last[draft[i]] = 0.0                                # p - point mass, clamped at 0
        else:
            last = (p[i] - q[i]).clamp_min_(0.0)
        if not bool(last.sum() > 0):
            # Only rounding can get here: a rejection has probability sum(max(0, q - p)), which
            # is 0 exactly when p == q, and then the residual would be empty too.
            last = p[i]
    # The race needs no normalisation: argmax of p/E does not change when p is scaled.
    token = int(exponential_race(last[None], [generator])[0])
    return draft[:accepted] + [token], accepted


def verify_batch(sampler: Sampler, logits: Tensor, seqs: list[Sequence],
                 drafts: list[Draft | None]) -> list[tuple[list[int], int]]:
    """logits: [sum of (1 + len(draft)) rows, V], each sequence's rows in order.
    Returns, per sequence, (tokens to append, number of drafts accepted)."""
    sizes = [1 + (len(d.tokens) if d else 0) for d in drafts]
    argmax = logits.argmax(dim=-1).tolist()
    probs = None
    if not all(s.params.greedy for s in seqs):
        # The distribution the plain engine samples from (lesson 06: temperature, top-k, top-p, min-p).
        probs = sampler.probs(logits, [s.params for s, n in zip(seqs, sizes) for _ in range(n)])
    out, start = [], 0
    for seq, d, n in zip(seqs, drafts, sizes):
        tokens = d.tokens if d else []
        if seq.params.greedy:
            out.append(verify_greedy(argmax[start:start + n], tokens))
        else:
            out.append(rejection_sample(probs[start:start + n], tokens, d.probs if d else None, seq.generator))
        start += n
    return out
