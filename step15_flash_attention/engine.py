"""The engine from this lesson on: lesson 09's step loop, handed its parts as objects.

Lessons 09-14 grew the engine one subclass per lesson. From here on a lesson changes a part,
not the engine: the engine is given them, and `build_engine` shows where each comes from.

    part           what it does                                           taught in
    model          the transformer; transforms (packing, ...) applied     04 (14: packing)
                   by whoever builds the engine, never by the engine
    scheduler      waiting/running queues, chunks, preemption, prefix     09, 10, 11, 13
      block_manager  inside it: which blocks each sequence holds          12, 13
    kv_pool        the K/V tensors, in the layout the backend reads       12, 14
    attention      the attention backend: which kernel runs attention     15 (this lesson)
    runner         how a step's forward runs: `ModelRunner` runs it       15 (16: recorded steps,
                   eagerly                                                    17: the CPU fast path)
    sampler        greedy, temperature, top-k, top-p, min-p                06
    output_processor  optional: reads the step's logits after sampling    20 (logprobs)

One step (lesson 09's `step`, unchanged): scheduler.schedule() -> runner.forward(batch,
ids, positions, step attention) -> runner.compute_logits -> sampler -> scheduler.after_step.
The step attention (`FlashPagedAttention`, attention.py) is this step's metadata plus the
backend's kernel: what every layer calls.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Sequence as Seq

from torch import Tensor, nn

from step04_transformer.model import StepAttention
from step06_sampler.sampler import Sampler
from step09_continuous_batching.engine import LLMEngine
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedScheduler, PagedSchedulerConfig
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from step13_prefix_cache.engine import PrefixCachingScheduler
from step14_batched_forward.engine import EngineStats, TokenCounters
from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.attention import FlashPagedAttention
from step15_flash_attention.backends import AttentionBackend, choose_backend


class ModelRunner:
    """Runs a step's forward: one eager call of the model; logits from its head."""

    def __init__(self, model: nn.Module):
        self.model = model

    def forward(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor, attn: StepAttention) -> Tensor:
        return self.model(input_ids, positions, attn)

    def replays_step(self, batch: ScheduledBatch) -> bool:
        """Whether forward runs this batch from buffers of its own (lesson 16's recorded steps),
        so it needs no step attention: this runner never does."""
        return False

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.model.compute_logits(hidden)


# Called after each step with the sequences that got a token (their new token appended) and
# their rows of the step's logits, in the same order.
OutputProcessor = Callable[[list[Sequence], Tensor], None]


class Engine(LLMEngine):
    def __init__(self, model: nn.Module, scheduler: PagedScheduler, kv_pool, attention: AttentionBackend,
                 runner: ModelRunner | None = None, sampler: Sampler | None = None, eos_ids: Seq[int] | None = None,
                 output_processor: OutputProcessor | None = None):
        if not isinstance(scheduler, PagedScheduler):
            raise TypeError(f"Engine needs a paged scheduler (lessons 12-13), got {type(scheduler).__name__}")
        super().__init__(model, scheduler, eos_ids, sampler)
        self.kv_pool, self.attention = kv_pool, attention
        self.runner = runner or ModelRunner(model)
        self.output_processor = output_processor
        self._step_logits: Tensor | None = None
        self.current_batch: ScheduledBatch | None = None   # the step in progress's, for a fault handler
        self.counters = TokenCounters()

    def prepare_kv(self, batch: ScheduledBatch) -> None:
        pass  # the scheduler already allocated every block this step writes to (lesson 12)

    def make_attention(self, batch: ScheduledBatch) -> FlashPagedAttention:
        return FlashPagedAttention(self.kv_pool, batch, self.attention)

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        self.current_batch = batch
        self.counters.count_prompt_tokens(batch)
        # A replayed step reads its own buffers: the metadata (a dozen small tensor ops) would be
        # built for nothing. An engine whose make_attention does more than that always builds it.
        if self.runner.replays_step(batch) and type(self).make_attention is Engine.make_attention:
            return self.runner.forward(batch, input_ids, positions, None)
        return self.runner.forward(batch, input_ids, positions, self.make_attention(batch))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.runner.compute_logits(hidden)
        if self.output_processor is not None:
            self._step_logits = logits          # rows in the order of the step's sampled sequences
        return logits

    def step(self) -> list[Sequence]:
        self._step_logits, self.current_batch = None, None
        sampled = super().step()
        self.counters.generation_tokens += len(sampled)
        if self.output_processor is not None and sampled and self._step_logits is not None:
            self.output_processor(sampled, self._step_logits)
        self._step_logits = None
        return sampled

    def close(self) -> None:
        """Release what the runner holds outside this process (lesson 17's workers); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> EngineStats:
        return self.counters.stats(self.scheduler)

    @property
    def prompt_tokens(self) -> int:
        return self.counters.prompt_tokens

    @property
    def generation_tokens(self) -> int:
        return self.counters.generation_tokens


# ---- the factories: each makes one part ------------------------------------------------------
def create_kv_pool(model: nn.Module, config: PagedSchedulerConfig, attention: AttentionBackend, extra_blocks: int = 0,
                   pool_class: type | None = None):
    """The pool the backend reads (its layout), sized from config.kv_cache_bytes, plus
    `extra_blocks` the block manager never hands out (lesson 16's scratch block). pool_class:
    a subclass of the backend's pool (lesson 16's CPU fast path: the same pool on 2 MB pages)."""
    pool_class = pool_class or attention.pool_class
    weight = model.model.embed_tokens.weight
    if not extra_blocks:
        return pool_class.from_memory_budget(model.config, config.kv_cache_bytes, config.block_size,
                                             weight.dtype, weight.device)
    num_blocks = config.kv_cache_bytes // pool_class.bytes_per_block(model.config, config.block_size, weight.dtype)
    if num_blocks < 1:                                  # from_memory_budget's check, without building it twice
        pool_class.from_memory_budget(model.config, config.kv_cache_bytes, config.block_size, weight.dtype,
                                      weight.device)
    return pool_class(model.config, int(num_blocks) + extra_blocks, config.block_size, weight.dtype, weight.device)


def create_scheduler(config: PagedSchedulerConfig, num_blocks: int, scheduler_class: type = PrefixCachingScheduler,
                     block_manager_class: type = PrefixCachingBlockManager) -> PagedScheduler:
    """Lesson 13's scheduler (chunked prefill, preemption, prefix caching) over `num_blocks`
    blocks; an advanced lesson may pass its own scheduler or block manager class."""
    return scheduler_class(config, block_manager_class(num_blocks, config.block_size))


def fit_block_size(config: PagedSchedulerConfig, attention: AttentionBackend) -> PagedSchedulerConfig:
    """The config with a block size the backend's kernel accepts (flash-attn 2: multiples of 256)."""
    multiple = attention.block_size_multiple
    return dataclasses.replace(config, block_size=multiple) if config.block_size % multiple else config


def build_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, attention_backend: str = "auto",
                 pack_weights: bool = True, sampler: Sampler | None = None, engine_class: type[Engine] = Engine,
                 **parts) -> Engine:
    """This lesson's engine: lesson 14's packed linears, the chosen backend, eager steps.
    parts: scheduler_class / block_manager_class for create_scheduler, and any keyword an
    engine_class (an advanced lesson's Engine subclass) takes."""
    config = config or PagedSchedulerConfig()
    if not isinstance(config, PagedSchedulerConfig):
        raise TypeError("the engine needs a PagedSchedulerConfig (block_size, kv_cache_bytes)")
    if pack_weights:
        model = pack_linears(model)                       # a packed copy (lesson 14)
    attention = choose_backend(attention_backend, model.model.embed_tokens.weight.device)
    config = fit_block_size(config, attention)
    pool = create_kv_pool(model, config, attention)
    scheduler = create_scheduler(config, pool.num_blocks, *scheduler_parts(parts))
    return engine_class(model, scheduler, pool, attention, ModelRunner(model), sampler, **parts)


def scheduler_parts(parts: dict) -> tuple[type, type]:
    """Take scheduler_class and block_manager_class out of `parts` (lesson 13's by default)."""
    return (parts.pop("scheduler_class", PrefixCachingScheduler),
            parts.pop("block_manager_class", PrefixCachingBlockManager))
