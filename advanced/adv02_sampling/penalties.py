"""From the model's logits to the logits the sampler sees: bad words, logit_bias, then the
repetition, frequency and presence penalties, for a whole batch at once.

    logits [B, V] --bad words--> --logit_bias--> --repetition--> --frequency/presence--> sampler

The order is vLLM's: bans and biases first (its "logits processors"), then the penalties. Each
row carries its own settings as a column tensor [B, 1]; a row with a setting "off" gets the
neutral value (penalty 1, penalty 0), which leaves its logits bit for bit unchanged, so rows
with different settings share every tensor operation. The only Python loops are over the
tokens a request has seen and over its bad words, never over the vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .params import SamplingParams, needs_penalties


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[B, V] float32: how often each token occurs in each row's list, by one scatter_add.

    Rows are padded with the id `vocab_size`, an extra column that is cut off afterwards, so
    lists of different lengths fill one rectangular tensor.
    """
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
    for r, toks in enumerate(token_lists):
        padded[r, :len(toks)] = torch.tensor(toks, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32))
    return counts[:, :vocab_size].to(device)


def banned_tokens(bad_words: list[list[int]], output_ids: list[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens the output has just produced.

    A bad word [a, b, c] bans c only right after the output ends with a, b; a one-token bad
    word is always banned. Like vLLM, only generated tokens count (the prompt may say it).
    """
    out = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix):] == prefix):
            out.append(word[-1])
    return out


def apply_penalties(logits: Tensor, params: list, prompt_ids: list[list[int]],
                    output_ids: list[list[int]]) -> Tensor:
    """New float32 logits [B, V]; the input is not modified (lesson 19 keeps it for raw logprobs)."""
    if logits.dim() != 2 or not logits.shape[0] == len(params) == len(prompt_ids) == len(output_ids):
        raise ValueError(f"logits must be [B, V] with B = len(params) = {len(params)}, got {tuple(logits.shape)}")
    logits = logits.float().clone()
    if not any(needs_penalties(p) for p in params):
        return logits
    B, V = logits.shape
    ps = [p if isinstance(p, SamplingParams) else None for p in params]
    dev = logits.device

    # 1. bad words: -inf where a banned sequence would be completed.
    rows, cols = [], []
    for r, p in enumerate(ps):
        if p is not None and p.bad_words_token_ids:
            for t in banned_tokens(p.bad_words_token_ids, output_ids[r]):
                rows.append(r)
                cols.append(t)
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")

    # 2. logit_bias: one indexed add over every (row, token, bias) of the batch.
    rows, cols, vals = [], [], []
    for r, p in enumerate(ps):
        for t, b in ((p.logit_bias or {}).items() if p is not None else ()):
            rows.append(r)
            cols.append(t)
            vals.append(b)
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, device=dev), accumulate=True)

    def column(name: str, off: float) -> Tensor:
        return torch.tensor([getattr(p, name) if p is not None else off for p in ps], device=dev).unsqueeze(1)

    rep = column("repetition_penalty", 1.0)
    freq, pres = column("frequency_penalty", 0.0), column("presence_penalty", 0.0)
    use_rep, use_fp = bool((rep != 1.0).any()), bool((freq != 0).any() or (pres != 0).any())
    if not (use_rep or use_fp):
        return logits
    counts = token_counts(output_ids, V, dev)                 # generated tokens only
    seen = counts > 0

    # 3. repetition penalty (HF's RepetitionPenaltyLogitsProcessor, vLLM's apply_penalties):
    # over prompt AND output; dividing a positive logit / multiplying a negative one both push
    # it toward "less likely", whatever its sign. Rows with penalty 1 are unchanged exactly.
    if use_rep:
        seen_any = seen | (token_counts(prompt_ids, V, dev) > 0)
        penalised = torch.where(logits < 0, logits * rep, logits / rep)
        logits = torch.where(seen_any, penalised, logits)

    # 4. OpenAI's frequency and presence penalties, over generated tokens only:
    # logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)
    if use_fp:
        logits = logits - (freq * counts + pres * seen.float())
    return logits
