"""The engine loop: schedule -> one forward for all scheduled tokens -> sample -> update.

The linear layers (most of the FLOPs) run once over the flattened tokens of every scheduled
sequence. Attention still loops over sequences, each with its own contiguous KV cache from
lesson 07; lesson 14 removes that loop.
"""
from __future__ import annotations

import time
from typing import Sequence as Seq

import torch
from torch import Tensor

from step04_transformer.model import CausalLM
from step05_naive.generate import check_prompt
from step06_sampler.params import SamplingParams
from step06_sampler.sampler import Sampler
from step07_kv_cache.kv_cache import KVCache, cached_attention
from step09_continuous_batching.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from step09_continuous_batching.sequence import Sequence


class PerSequenceAttention:
    """Backend for a batch of sequences laid end to end: split, attend each over its cache, join."""

    def __init__(self, batch: ScheduledBatch):
        self.segments = [(s.kv_cache, s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_tokens)]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs, off = [], 0
        for cache, start, n in self.segments:
            outs.append(cached_attention(cache, layer_idx, start, q[off:off + n], k[off:off + n], v[off:off + n]))
            off += n
        return torch.cat(outs)


class LLMEngine:
    def __init__(self, model: CausalLM, scheduler: Scheduler | SchedulerConfig | None = None,
                 eos_ids: Seq[int] | None = None, sampler: Sampler | None = None):
        self.model = model
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        if not isinstance(scheduler, Scheduler):
            scheduler = self.make_scheduler(scheduler or SchedulerConfig())
        self.scheduler = scheduler
        self.eos_ids = list(model.config.eos_token_ids if eos_ids is None else eos_ids)
        self.sampler = sampler or Sampler()
        self.num_steps = 0

    def make_scheduler(self, config: SchedulerConfig) -> Scheduler:
        return Scheduler(config)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> Sequence:
        params = params or SamplingParams()
        cfg = self.model.config
        check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, params.max_tokens)
        seq = Sequence(list(prompt_ids), params)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Sequence]:
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            self.step()
        return seqs

    # ---- one engine step -----------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one scheduled batch; return the sequences that received a token this step."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.prepare_kv(batch)
        ids, positions, last_rows, sampled = [], [], [], []
        off = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            off += n
            if start + n == seq.num_tokens:          # prompt done (or a decode): sample its next token
                last_rows.append(off - 1)
                sampled.append(seq)
        # Made on the model's device: the embedding, RoPE tables and hidden states live there.
        hidden = self.run_model(batch, torch.tensor(ids, device=self.device),
                                torch.tensor(positions, device=self.device))
        tokens: list[int] = []
        if sampled:
            logits = self.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
            tokens = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled]).tolist()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        self.scheduler.after_step(batch)
        now = time.perf_counter()
        for seq, tok in zip(sampled, tokens):
            seq.token_ids.append(tok)
            seq.token_times.append(now)
            reason = seq.params.finish_reason(tok, len(seq.output_token_ids), self.eos_ids)
            if reason:
                self.scheduler.finish(seq, reason)
        self.num_steps += 1
        return sampled

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        """The step's forward pass, [T] -> [T, hidden]; lesson 16 runs decode steps another way."""
        return self.model(input_ids, positions, self.make_attention(batch))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.model.compute_logits(hidden)

    # ---- where K/V live: the part lesson 12 replaces ---------------------------------------
    def prepare_kv(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.kv_cache is None:
                seq.kv_cache = KVCache(self.model.config, seq.num_prompt_tokens + seq.params.max_tokens, self.dtype)
            seq.kv_cache.reserve(seq.num_computed_tokens + n)

    def make_attention(self, batch: ScheduledBatch):
        return PerSequenceAttention(batch)
