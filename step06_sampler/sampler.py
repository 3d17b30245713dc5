"""Lesson 06: from a batch of logits to one next token per row.

    logits [B, V] --temperature--> --min-p--> --top-k--> --top-p--> softmax --> race --> tokens [B]

Every filter is a pure function on a whole batch: it takes float32 logits [B, V] and one
parameter per row (a tensor [B]) and returns new logits in which the tokens it removes are
-inf. A row whose parameter means "off" comes back unchanged, so requests with different
settings share one batch. The order (temperature, min-p, top-k, top-p) is vLLM's.

The draw is an "exponential race" (the Gumbel-max trick in another form): with
E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with probability exactly p_i. The
E_i of a row with a seed come from that row's own torch.Generator, so its tokens depend on
its seed and nothing else in the batch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .params import SAMPLING_EPS, SamplingParams

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- filters

def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide each row by its temperature: T < 1 sharpens, T > 1 flattens.

    Rows with T < SAMPLING_EPS are greedy; they are divided by 1 (left as they are): T = 0
    would divide by zero, and greedy rows take the argmax of the raw logits anyway.
    """
    t = temperature.to(device=logits.device, dtype=torch.float32)
    t = torch.where(t < SAMPLING_EPS, torch.ones_like(t), t)
    return logits.float() / t.unsqueeze(1)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep the tokens with probability >= min_p * (probability of the most likely token).

    min_p = 0 keeps everything. The cut-off scales with the model's confidence: a peaked
    distribution keeps few tokens, a flat one keeps many.
    """
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep the k largest logits of each row; k <= 0 (or k >= V) keeps all.

    Ties: every token whose logit equals the k-th largest is kept, so a row can keep more
    than k tokens when several share the k-th value (vLLM behaves the same way).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    k = top_k.to(device=logits.device, dtype=torch.long)
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    # Only the k_max best of each row are needed to find every row's k-th value.
    best = logits.topk(int(k.max()), dim=-1).values                    # [B, k_max], descending
    kth = best.gather(1, (k - 1).unsqueeze(1))                         # [B, 1]
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose total probability reaches p.

    Walk the tokens from most to least likely; a token is kept while the probability of the
    tokens before it is still below p. So the top token is always kept, and the token that
    makes the sum reach p is kept too. p = 1 keeps everything. When equal probabilities
    straddle the cut, which of them is kept is up to torch.topk (vLLM: up to torch.sort).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    p = top_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1)    # [B, 1]
    active = p < 1.0                                                          # p = 1 is exactly "off"
    probs = logits.softmax(dim=-1)
    # The textbook version sorts the whole row: O(V log V) for a 152k vocabulary, every step.
    # The kept set is nearly always small, so look at the k most likely tokens first and widen
    # k only while some row's k best have not yet reached p. Same answer (up to float rounding
    # at the cut), one cheap topk pass in the common case.
    k = min(vocab, 64)
    while True:
        top_probs, top_ids = probs.topk(k, dim=-1)                            # sorted, descending
        reached = top_probs.sum(dim=-1, keepdim=True) >= p
        if k == vocab or bool((reached | ~active).all()):
            break
        k = min(vocab, k * 8)
    mass_before = top_probs.cumsum(dim=-1) - top_probs                       # probability ranked above
    keep_top = mass_before < p
    keep_top[:, 0] = True                                                     # always keep the top token
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top_ids, keep_top)
    return logits.masked_fill(~(keep | ~active), NEG_INF)


# ----------------------------------------------------------------------------- drawing

def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator seeded with params.seed, or None (use the global RNG) if no seed.

    Create it once per request and pass the same object every step: it carries the
    request's position in its random stream from one step to the next.
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def row_argmax(x: Tensor) -> Tensor:
    """x.argmax(dim=-1), the same indices (the first of equal maxima, NaN wins); on the CPU
    torch's max(dim=-1) reduction was faster than its argmax over [64, 151936] rows."""
    return x.max(dim=-1).indices


def exponential_race(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Draw one token per row: argmax_i probs[i] / E_i with E_i ~ Exp(1).

    Why it is exact: P(E_i / p_i > t) = exp(-p_i t), so E_i / p_i is an exponential "finish
    time" with rate p_i, and the first of independent exponential clocks to finish is clock i
    with probability p_i / sum(p) = p_i. The smallest E_i / p_i is the largest p_i / E_i.
    Taking logs gives Gumbel-max: argmax(log p_i + G_i) with G_i = -log E_i ~ Gumbel(0, 1).

    Rows with a generator draw their noise from it; all other rows share one vectorised draw
    from the global RNG. A masked token (p = 0) can never win: 0 / E = 0.
    """
    q = torch.empty_like(probs, dtype=torch.float32)
    if any(g is None for g in generators):
        q.exponential_()                                 # one draw for the whole batch
    for row, gen in enumerate(generators):
        if gen is not None:
            q[row].exponential_(generator=gen)           # this request's own stream
    # exponential_ may return exactly 0 (u = 0); clamp so p / q stays finite (0 / 0 = NaN
    # would win torch.argmax).
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return row_argmax(probs.float().div(q))


# ----------------------------------------------------------------------------- the sampler

class Sampler:
    """Batched sampler: one next token per row, each row with its own SamplingParams.

    Filters that no row uses are skipped (each one costs passes over the whole vocabulary),
    and a batch in which every row is greedy never computes a softmax at all.
    """
    argmax = staticmethod(row_argmax)   # the greedy pick; lesson 16 swaps in a C pass

    @staticmethod
    def _check(logits: Tensor, params: list[SamplingParams]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits must be [B, V] with B = len(params) = {len(params)}, "
                             f"got shape {tuple(logits.shape)}")

    def filtered_logits(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """float32 logits after temperature, min-p, top-k and top-p (removed tokens: -inf)."""
        self._check(logits, params)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)

        x = apply_temperature(logits, column([p.temperature for p in params], torch.float32))
        if any(p.min_p > 0 for p in params):
            x = apply_min_p(x, column([p.min_p for p in params], torch.float32))
        if any(p.top_k > 0 for p in params):
            x = apply_top_k(x, column([p.top_k for p in params], torch.long))
        if any(p.top_p < 1 for p in params):
            x = apply_top_p(x, column([p.top_p for p in params], torch.float32))
        return x

    def probs(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """The distribution each row is sampled from [B, V]; a greedy row is one-hot at its argmax.

        This is the target that the sampled frequencies must match (see tests and run.py).
        """
        probs = self.filtered_logits(logits, params).softmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=logits.device)
        if greedy.any():
            one_hot = torch.zeros_like(probs).scatter_(1, row_argmax(logits).unsqueeze(1), 1.0)
            probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
        return probs

    def __call__(self, logits: Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None] | None = None) -> Tensor:
        """Next token per row, a long tensor [B].

        generators[i] is row i's generator from make_generator (None: global RNG). Pass the
        same generator objects every step; a row's tokens then depend only on its logits,
        its params and its own generator.
        """
        self._check(logits, params)
        if generators is None:
            generators = [None] * len(params)
        if len(generators) != len(params):
            raise ValueError(f"got {len(generators)} generators for {len(params)} rows")
        tokens = self.argmax(logits)                     # greedy rows are done here
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) == len(params):                     # no greedy row: the whole batch at once
            return exponential_race(self.filtered_logits(logits, params).softmax(dim=-1), generators)
        if rows:                                         # mixed: sample only the random rows
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            sub = self.filtered_logits(logits[idx], [params[i] for i in rows])
            tokens[idx] = exponential_race(sub.softmax(dim=-1), [generators[i] for i in rows])
        return tokens

