"""The whole engine on one page: every part the lessons built, in the order a request meets them.

Read it first, as a map of where the lessons are going, or last, to see the engine at once.
Each part is imported from the lesson that teaches it; nothing here is new except the order.
`build_engine` makes the same engine as lesson 16's fast-path build_engine (tested token for token), and
`OnePageEngine.step` is lesson 09's step as the parts of lessons 12-16 run it.

    build_engine(model)                                  taught in
      model transforms: pack linears, fuse q|k|v and     14 (packing), 17 (fusion, library ops)
        gate|up, route through library ops (new model)
      attention backend: which kernel reads the pool     15
      KV pool, + 1 scratch block for padded rows         12 (paged), 14 (head-major), 16 (scratch)
      block manager: blocks, ref counts, prefix hashes   12, 13
      scheduler: queues, chunks, preemption, prefixes    09, 10, 11, 13
      model runner: buckets replayed, prompt steps       16 (recorded steps), 17 (CPU fast path)
        compiled, packed LM head
      sampler: greedy / temperature / top-k/p / min-p    06 (17: greedy as one C pass)

    OnePageEngine.step()
      scheduler.schedule()      who runs, with how many tokens; allocates their blocks (09-13)
      flatten the batch         token ids and positions of all sequences end to end (09, 14)
      FlashPagedAttention       the step's metadata: slots, cu_seqlens, block tables (15)
      runner.forward            replay a bucket, or run the compiled/eager forward (16, 17)
      runner.compute_logits     only the rows that get a token (09)
      sampler                   one token per finished row (06)
      scheduler.after_step      full blocks become reusable prefixes (13)
      append, finish            stop on EOS / max_tokens / stop ids; blocks go back (06, 12)
"""
from __future__ import annotations

import time
from typing import Sequence as Seq

import torch
from torch import Tensor, nn

from step05_naive.generate import check_prompt                            # lesson 05
from step06_sampler.params import SamplingParams                          # lesson 06
from step06_sampler.sampler import Sampler
from step09_continuous_batching.sequence import Sequence                  # lesson 09
from step12_paged_attention.scheduler import PagedScheduler, PagedSchedulerConfig   # lesson 12
from step13_prefix_cache.block_manager import PrefixCachingBlockManager    # lesson 13
from step13_prefix_cache.engine import PrefixCachingScheduler
from step15_flash_attention.attention import FlashPagedAttention          # lesson 15
from step15_flash_attention.backends import AttentionBackend, choose_backend
from step15_flash_attention.engine import ModelRunner
from step16_cuda_graph.runner import GraphRunner, compile_works           # lesson 16
from step16_cuda_graph.cpu.engine import KernelSampler, cpu_fast_path        # lesson 16's fast path
from step16_cuda_graph.cpu.runner import CpuGraphRunner


class OnePageEngine:
    def __init__(self, model: nn.Module, scheduler: PagedScheduler, kv_pool, attention: AttentionBackend,
                 runner: ModelRunner, sampler: Sampler, eos_ids: Seq[int]):
        self.model, self.scheduler, self.kv_pool = model, scheduler, kv_pool
        self.attention, self.runner, self.sampler = attention, runner, sampler
        self.eos_ids = list(eos_ids)
        self.device = model.model.embed_tokens.weight.device
        self.num_steps = 0

    def add_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> Sequence:
        params = params or SamplingParams()
        cfg = self.model.config
        check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, params.max_tokens)   # 05
        seq = Sequence(list(prompt_ids), params)
        self.scheduler.add(seq)            # refuses what could never fit (09, 12)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | None = None) -> list[Sequence]:
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return seqs

    def step(self) -> list[Sequence]:
        """One scheduled batch; returns the sequences that received a token."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        ids, positions, last_rows, sampled = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            if start + n == seq.num_tokens:        # its prompt is done (or it decodes): it gets a token
                last_rows.append(len(ids) - 1)
                sampled.append(seq)
        attn = FlashPagedAttention(self.kv_pool, batch, self.attention)
        hidden = self.runner.forward(batch, self.tensor(ids), self.tensor(positions), attn)
        tokens: list[int] = []
        if sampled:
            logits = self.runner.compute_logits(hidden[self.tensor(last_rows)])
            tokens = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled]).tolist()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        self.scheduler.after_step(batch)
        now = time.perf_counter()
        for seq, token in zip(sampled, tokens):
            seq.token_ids.append(token)
            seq.token_times.append(now)
            reason = seq.params.finish_reason(token, len(seq.output_token_ids), self.eos_ids)
            if reason:
                self.scheduler.finish(seq, reason)
        self.num_steps += 1
        return sampled

    def tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, device=self.device)


def build_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, attention_backend: str = "auto",
                 use_graph: bool = True) -> OnePageEngine:
    """The final single-process engine from its parts (lesson 16's fast-path, written out)."""
    config = config or PagedSchedulerConfig()
    device = model.model.embed_tokens.weight.device
    attention = choose_backend(attention_backend, device)                                     # 15
    cpu_path = device.type == "cpu" and attention.name == "cpu" and use_graph and compile_works()
    if device.type == "cpu":
        model = cpu_fast_path(model)                                                          # 14, 17
    if config.block_size % attention.block_size_multiple:                                     # 15
        raise ValueError(f"the {attention.name} kernel needs blocks of a multiple of {attention.block_size_multiple}")
    weight = model.model.embed_tokens.weight
    blocks = attention.pool_class.from_memory_budget(model.config, config.kv_cache_bytes, config.block_size,
                                                     weight.dtype, device).num_blocks
    scratch = blocks if use_graph else None                                                   # 16
    pool = attention.pool_class(model.config, blocks + (scratch is not None), config.block_size, weight.dtype, device)
    scheduler = PrefixCachingScheduler(config, PrefixCachingBlockManager(blocks, config.block_size))   # 09-13
    max_bucket = config.max_num_seqs
    if cpu_path:
        runner = CpuGraphRunner(model, pool, attention, max_bucket, scratch)                  # 17
        runner.warm_up()
    elif use_graph:
        runner = GraphRunner(model, pool, attention, max_bucket, scratch)                     # 16
        runner.record_all()
    else:
        runner = ModelRunner(model)                                                           # 15
    sampler = KernelSampler() if cpu_path else Sampler()                                      # 06, 17
    return OnePageEngine(model, scheduler, pool, attention, runner, sampler, model.config.eos_token_ids)
