"""Lesson 15's engine running the hybrid model: paged KV for the attention layers, a state slot
per sequence for the DeltaNet layers.

What changes against lesson 15 (`step15_flash_attention.engine`):
  - the scheduler (lesson 12's: chunked prefill, preemption, blocks) also hands out state
    slots: one on admission, back on finish and on preemption (HybridScheduler);
  - the step the model is handed is lesson 15's paged step attention plus a RecurrentStep over
    the state pool (HybridEngine.make_attention); the KV pool holds the attention layers only;
  - no prefix cache: lesson 13 would let a new request skip the tokens of a cached prefix, but
    the DeltaNet layers have no state for "after those tokens" to start from; prefix_state.py
    adds state checkpoints for that.

Preemption recomputes the state, as vLLM does for its Mamba-style layers: the preempted
sequence's slot is freed and, when it is admitted again, its prompt and generated tokens are
prefilled from position 0 (lesson 11), which rebuilds its KV blocks and its state together.
Saving the state instead would save nothing: the attention layers' K/V must be recomputed
by that same prefill anyway, and the DeltaNet layers ride along with it.
"""
from __future__ import annotations

from torch import nn

from step06_sampler.sampler import Sampler
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.block_manager import BlockManager
from step12_paged_attention.scheduler import PagedScheduler, PagedSchedulerConfig
from step14_batched_forward.engine import EngineStats
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import Engine, ModelRunner, create_scheduler, fit_block_size
from advanced.adv13_linear_attention.model import HybridLM
from advanced.adv13_linear_attention.state_pool import HybridStep, RecurrentStep, StatePool, StateSlots


class HybridScheduler(PagedScheduler):
    """Lesson 12's scheduler; each running sequence also holds one state slot. There are
    max_num_seqs slots, so admission (which already stops at max_num_seqs) always finds one."""

    def __init__(self, config: PagedSchedulerConfig, block_manager: BlockManager):
        super().__init__(config, block_manager)
        self.slots = StateSlots(config.max_num_seqs)

    def admit(self, seq: Sequence) -> None:
        super().admit(seq)
        self.slots.allocate(seq)

    def preempt(self, seq: Sequence) -> None:
        super().preempt(seq)            # its KV blocks are already released; recomputed from 0 later
        self.slots.free(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.slots.free(seq)
        super().finish(seq, reason)


class HybridEngine(Engine):
    def __init__(self, model: HybridLM, scheduler: HybridScheduler, kv_pool, attention, runner=None,
                 sampler: Sampler | None = None, eos_ids=None, output_processor=None,
                 state_pool: StatePool | None = None):
        if not isinstance(scheduler, HybridScheduler):
            raise TypeError(f"the hybrid engine needs a HybridScheduler (it hands out state slots), "
                            f"got {type(scheduler).__name__}")
        if state_pool is None or state_pool.num_slots < scheduler.slots.num_slots:
            raise ValueError("the hybrid engine needs a state_pool with a slot for each of max_num_seqs sequences")
        super().__init__(model, scheduler, kv_pool, attention, runner, sampler, eos_ids, output_processor)
        self.state_pool = state_pool

    def make_attention(self, batch: ScheduledBatch) -> HybridStep:
        recurrent = RecurrentStep.for_batch(self.state_pool, self.scheduler.slots, batch)
        return HybridStep(super().make_attention(batch), recurrent)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), s.num_used_blocks, s.block_manager.num_blocks, 0, 0,
                           s.num_preemptions, self.prompt_tokens, self.generation_tokens)


def build_hybrid_engine(model: HybridLM, config: PagedSchedulerConfig | None = None, attention_backend: str = "auto",
                        sampler: Sampler | None = None, engine_class: type[HybridEngine] = HybridEngine,
                        **parts) -> HybridEngine:
    """Lesson 15's parts for a hybrid model: its attention backend and KV pool (attention layers
    only, sized from config.kv_cache_bytes), lesson 12's scheduler with state slots, eager steps.
    The state pool comes on top of kv_cache_bytes: max_num_seqs slots of fixed size."""
    config = config or PagedSchedulerConfig()
    if not isinstance(config, PagedSchedulerConfig):
        raise TypeError("the engine needs a PagedSchedulerConfig (block_size, kv_cache_bytes)")
    if not isinstance(model, nn.Module) or not hasattr(getattr(model, "config", None), "linear_layers"):
        raise TypeError(f"build_hybrid_engine runs a HybridLM (load_hybrid), got {type(model).__name__}")
    if not model.config.attention_layers:
        raise NotImplementedError("a stack with no attention layer has no KV to page; this engine needs at least one")
    weight = model.model.embed_tokens.weight
    attention = choose_backend(attention_backend, weight.device)
    config = fit_block_size(config, attention)
    kv_pool = attention.pool_class.from_memory_budget(model.config.kv_config(), config.kv_cache_bytes,
                                                      config.block_size, weight.dtype, weight.device)
    scheduler = create_scheduler(config, kv_pool.num_blocks, HybridScheduler, BlockManager)
    states = StatePool(model.config, config.max_num_seqs, weight.dtype, weight.device)
    return engine_class(model, scheduler, kv_pool, attention, ModelRunner(model), sampler, state_pool=states, **parts)


def kv_bytes_held(engine: HybridEngine) -> int:
    """Bytes of KV blocks the running sequences hold at this point."""
    pool = engine.kv_pool
    per_block = sum(t[0].numel() * t.element_size() for t in pool.k + pool.v)
    return engine.scheduler.num_used_blocks * per_block


def state_bytes_held(engine: HybridEngine) -> int:
    slots = engine.scheduler.slots
    return (slots.num_slots - slots.num_free_slots) * engine.state_pool.bytes_per_slot

