"""The engine the `LLM` API drives: lesson 17's (lesson 16's fast-path when tensor_parallel_size is 1),
plus log-probabilities.

What changes against lesson 17: a request whose params ask for `logprobs` gets, for every
generated token, a dict {token id: Logprob} on `seq.logprobs`: the chosen token and the top
`logprobs` tokens of the model's distribution. As in vLLM (its default "raw_logprobs"), they
come from the logits as the model produced them, before temperature and the top-k/top-p/min-p
filters: they say what the model thought, not what the sampler was allowed to pick.

The cost is paid only by steps that have such a request: one log_softmax and one topk over
the vocabulary for those rows. The logits are already there (the sampler needed them): lesson
15's Engine hands them, after the step, to its output processor, `record_step_logprobs`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from step06_sampler.params import SamplingParams as EngineSamplingParams
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.engine import TPEngine
from step19_real_model.outputs import Logprob


def record_step_logprobs(sampled: list[Sequence], logits: Tensor) -> None:
    """Lesson 15's Engine calls this after each step (its output_processor) with the sequences
    that got a token and their logits rows: record logprobs for those that asked."""
    rows = [i for i, s in enumerate(sampled) if getattr(s, "logprobs", None) is not None]
    if rows:
        record_logprobs(logits[rows], [sampled[i] for i in rows])


def record_logprobs(logits: Tensor, seqs: list[Sequence]) -> None:
    """Append one {token id: Logprob} per sequence: its last token first, then its top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor([s.token_ids[-1] for s in seqs])
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))                       # [B, 1]
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1                             # 1 = the best
    k = max(s.params.logprobs for s in seqs)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen, chosen_lp, ranks = chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp, top_ids = (top_lp.tolist(), top_ids.tolist()) if k else ([], [])
    for r, seq in enumerate(seqs):
        entry = {chosen[r]: Logprob(chosen_lp[r], ranks[r])}
        for j in range(seq.params.logprobs):
            entry.setdefault(top_ids[r][j], Logprob(top_lp[r][j], j + 1))
        seq.logprobs.append(entry)


class LogprobsEngine(TPEngine):
    """Lesson 17's engine with logprobs: TPEngine(folder, config, tensor_parallel_size=...)
    whose output processor is record_step_logprobs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, output_processor=record_step_logprobs, **kwargs)

    def add_request(self, prompt_ids, params: EngineSamplingParams | None = None) -> Sequence:
        seq = super().add_request(prompt_ids, params)
        seq.logprobs = [] if getattr(seq.params, "logprobs", None) is not None else None
        return seq


def build_engine(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, *, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, launch=None,
                 threads_per_rank: int | None = None) -> LogprobsEngine:
    """enforce_eager: no graph capture (vLLM's flag of the same name): quicker to start,
    slower decode steps; the tests use it. threads_per_rank: torch threads of each rank
    (default: the machine's cores split over the ranks)."""
    config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  kv_cache_bytes=kv_cache_bytes)
    return LogprobsEngine(model_dir, config, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                          use_graph=not enforce_eager, launch=launch,
                          threads_per_rank=threads_per_rank)
