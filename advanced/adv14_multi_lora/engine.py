"""Lesson 15's engine serving many LoRA adapters at once: the adapter rides on each request.

    add_request(ids, params, lora_request)   seq.lora_name = "sql"  (None: the base model)
    schedule()   LoRAScheduler: a waiting request whose adapter has no slot (all pinned by
                 running requests) waits, and those behind it that can run go first; on
                 admission its adapter is loaded into a slot (manager.py), maybe evicting one
    run_model()  rows of the flat batch -> slots -> LoRAMapping (lora_linear.py), read by every
                 LoRALinear of the forward; then lesson 15's forward, unchanged
    prefix cache a block's K/V depend on the adapter (k_proj, v_proj and every layer below are
                 adapted), so a block cached by one adapter must never serve another:
                 LoRABlockManager keeps adapter requests out of lesson 13's cache

The model path: lesson 15's eager forward with lesson 14's packed linears, each q/k/v/o/gate/
up/down wrapped in a LoRALinear. Lesson 16's fast path fuses q|k|v and gate|up into one matmul
and compiles the step around Python-free calls; the per-step LoRA mapping would need both
undone (slices of the fused output, the mapping as graph inputs), so this engine stays eager.
"""
from __future__ import annotations

from torch import Tensor, nn

from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence, SequenceStatus
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.block_manager import PrefixCachingBlockManager
from step13_prefix_cache.engine import PrefixCachingScheduler
from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.engine import Engine, build_engine
from step19_real_model.engine import record_step_logprobs

from .adapters import LoRARequest
from .lora_linear import STRATEGIES, add_lora_layers
from .manager import LoRAManager

STACKED_MAX_ROWS = 64     # "auto": steps of at most this many rows take the stacked path


def lora_name(seq: Sequence) -> str | None:
    return getattr(seq, "lora_name", None)


class LoRABlockManager(PrefixCachingBlockManager):
    """Lesson 13's prefix cache for base-model requests only: an adapter request neither reuses
    cached blocks nor offers its own (vLLM instead salts the block hash with the adapter id)."""

    def match_prefix(self, seq: Sequence) -> int:
        if lora_name(seq) is None:
            return super().match_prefix(seq)
        self.seq_hashes[seq.seq_id] = []
        self.query_tokens += seq.num_tokens
        return 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        if lora_name(seq) is None:
            super().cache_full_blocks(seq)


class LoRAScheduler(PrefixCachingScheduler):
    loras: LoRAManager          # set by LoRAEngine

    def pinned(self) -> set[str]:
        return {n for n in map(lora_name, self.running) if n is not None}

    def begin_step(self) -> None:
        super().begin_step()
        # Requests whose adapter cannot get a slot now step aside (stable: order kept otherwise),
        # so a base request is not stuck behind an adapter waiting for a slot.
        pinned = self.pinned()
        if self.waiting and not self.loras.can_place(lora_name(self.waiting[0]), pinned):
            ready = [s for s in self.waiting if self.loras.can_place(lora_name(s), pinned)]
            blocked = [s for s in self.waiting if not self.loras.can_place(lora_name(s), pinned)]
            self.waiting.clear()
            self.waiting.extend(ready + blocked)

    def room(self, seq: Sequence) -> int:
        # A waiting request whose adapter has no slot has no room: admission stops at it.
        if seq.status is SequenceStatus.WAITING and not self.loras.can_place(lora_name(seq), self.pinned()):
            return 0
        return super().room(seq)

    def admit(self, seq: Sequence) -> None:
        name = lora_name(seq)
        if name is not None:
            self.loras.acquire(name, self.pinned())
        super().admit(seq)


class LoRAEngine(Engine):
    def __init__(self, *args, loras: LoRAManager, lora_strategy: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler, LoRAScheduler):
            raise TypeError(f"LoRAEngine needs a LoRAScheduler, got {type(self.scheduler).__name__}")
        if lora_strategy not in STRATEGIES:
            raise ValueError(f"lora_strategy must be one of {STRATEGIES}, got {lora_strategy!r}")
        self.loras, self.lora_strategy = loras, lora_strategy
        self.scheduler.loras = loras

    def add_request(self, prompt_ids, params=None, lora_request: LoRARequest | None = None) -> Sequence:
        """lora_request: the adapter for this request; by default the one its params carry
        (llm.py's LoRASamplingParams); None: the base model."""
        lora_request = lora_request or getattr(params, "lora_request", None)
        if lora_request is not None:
            self.loras.register(lora_request)          # checks the folder the first time
        seq = super().add_request(prompt_ids, params)
        seq.lora_name = None if lora_request is None else lora_request.lora_name
        # As lesson 19's LogprobsEngine: a list to fill when the request asked for logprobs.
        seq.logprobs = [] if getattr(seq.params, "logprobs", None) is not None else None
        return seq

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        names = [lora_name(s) for s in batch.seqs]
        used = {n for n in names if n is not None}
        self.loras.touch(used)
        stacked = self.lora_strategy == "stacked" or (self.lora_strategy == "auto" and
                                                      batch.total_tokens <= STACKED_MAX_ROWS and len(used) > 1)
        self.loras.set_step(names, batch.num_tokens, stacked)
        try:
            return super().run_model(batch, input_ids, positions)
        finally:
            self.loras.clear_step()


def build_lora_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, *, max_loras: int = 4,
                      max_lora_rank: int = 16, lora_strategy: str = "auto", attention_backend: str = "auto",
                      output_processor=record_step_logprobs) -> LoRAEngine:
    """Lesson 14's packing, LoRA layers on every projection (max_loras slots of rank up to
    max_lora_rank), then lesson 15's build_engine with this lesson's engine and scheduler.
    `model` is not changed. output_processor: lesson 19's logprobs by default."""
    model, layers, state = add_lora_layers(pack_linears(model), max_loras, max_lora_rank)
    loras = LoRAManager(layers, state, model.config, max_loras, max_lora_rank, model.model.embed_tokens.weight.dtype)
    return build_engine(model, config, attention_backend, pack_weights=False, engine_class=LoRAEngine,
                        scheduler_class=LoRAScheduler, block_manager_class=LoRABlockManager, loras=loras,
                        lora_strategy=lora_strategy, output_processor=output_processor)
