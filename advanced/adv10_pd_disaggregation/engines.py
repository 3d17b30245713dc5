"""The prefill engine and the decode engine: lesson 15's Engine, each with a connector.

    prefill engine                                  decode engine
    add_request(prompt, max_tokens=1, producer)     add_request(prompt, params, consumer)
    step: schedule -> meta (saves) -> forward:      step: open loads -> copy the layers that have
          layer l attention writes K/V, then              landed into the pool -> a request whose
          save_kv_layer(l) ships layer l                  last layer is in joins the batch with all
          -> sample its one token -> finish               but its last prompt token computed
                                                         -> its first step computes that token

A transfer that fails (a layer lost or late, a damaged layer) is asked for again once, when
the engine has someone to ask (`on_retry`): counted in `retries`. If it fails again, or the
prefill engine is gone, the request keeps its blocks and recomputes its prompt here: counted in
`fallbacks`, with the reason, never silent.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from step05_naive.generate import check_prompt
from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step13_prefix_cache.engine import PrefixCachingScheduler
from step15_flash_attention.engine import Engine
from step16_cuda_graph.cpu.engine import build_engine
from advanced.adv10_pd_disaggregation.connector import (ConnectorScheduler, ConnectorWorker, OpenLoad,
                                                        TransferParams)

MakeWorker = Callable[[object, int], ConnectorWorker]     # (kv pool, num layers) -> the worker side


class SavingAttention:
    """The step's attention, then the connector's save of the layer it just wrote (vLLM calls
    save_kv_layer from inside each attention layer in the same way)."""

    def __init__(self, attn, worker: ConnectorWorker, pool):
        self.attn, self.worker, self.pool = attn, worker, pool

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self.attn(layer_idx, q, k, v)
        self.worker.save_kv_layer(layer_idx, self.pool)
        return out


class PrefillEngine(Engine):
    def __init__(self, *args, make_worker: MakeWorker, on_save_start: Callable[[list[int]], None] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.connector = ConnectorScheduler(self.kv_pool.block_size)
        self.worker = make_worker(self.kv_pool, self.model.config.num_layers)
        self.on_save_start = on_save_start       # told which requests start shipping, before the forward
        self._saving = False

    def add_prefill(self, req_id: int, prompt_ids: list[int], key: str) -> Sequence:
        seq = self.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        self.connector.register(seq, TransferParams(req_id, key, "producer"))
        return seq

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        meta = self.connector.build_connector_meta(batch)
        self.worker.bind(meta)
        self._saving = bool(meta.saves)
        if meta.saves and self.on_save_start is not None:
            self.on_save_start([s.req_id for s in meta.saves])
        try:
            return super().run_model(batch, input_ids, positions)
        finally:
            self.worker.wait_for_save()
            self._saving = False

    def make_attention(self, batch: ScheduledBatch):
        attn = super().make_attention(batch)
        return SavingAttention(attn, self.worker, self.kv_pool) if self._saving else attn

    def step(self) -> list[Sequence]:
        sampled = super().step()
        for seq in sampled:
            if seq.is_finished:
                self.connector.request_finished(seq)    # False: the blocks went back at finish
        return sampled


@dataclass
class Fallback:
    req_id: int
    reason: str
    tokens_recomputed: int


@dataclass
class Retry:
    """A transfer asked for again: why, and the first layer it still lacked."""
    req_id: int
    reason: str
    from_layer: int


class DecodeScheduler(PrefixCachingScheduler):
    """Lesson 13's scheduler, with a third place for a request besides waiting and running:
    `loading`, its blocks allocated while its KV streams in. It is not scheduled until then,
    so the running decodes never wait for a transfer."""
    connector: ConnectorScheduler

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived: deque[Sequence] = deque()      # consumer requests not yet given blocks
        self.loading: dict[int, Sequence] = {}       # req id -> seq, its KV on the way

    def add_consumer(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        self.arrived.append(seq)

    def open_loads(self) -> None:
        """Give each arrived request its blocks, first come first served: local prefix hits
        first (lesson 13), then the connector says how many more tokens the remote side has."""
        bm = self.block_manager
        while self.arrived:
            seq = self.arrived[0]
            bm.match_prefix(seq)
            remote = self.connector.get_num_new_matched_tokens(seq, seq.num_computed_tokens)
            if remote == 0:                           # nothing to load: an ordinary request
                self.waiting.append(self.arrived.popleft())
                continue
            if bm.blocks_for(seq.num_prompt_tokens) - len(seq.block_table) > bm.num_free_blocks:
                bm.free(seq)                          # no room yet: try again next step
                seq.num_computed_tokens = 0
                return
            bm.allocate(seq, seq.num_prompt_tokens)
            self.connector.update_state_after_alloc(seq, remote)
            self.loading[self.connector.params[seq.seq_id].req_id] = self.arrived.popleft()

    def load_done(self, load: OpenLoad) -> Sequence:
        seq = self.loading.pop(load.spec.req_id)
        seq.num_computed_tokens += load.spec.num_tokens   # only the last prompt token is left
        self.waiting.appendleft(seq)                      # first in line: its KV is already held
        return seq

    def load_failed(self, req_id: int) -> Sequence:
        """Back to waiting with its blocks and its local hit: the prompt is recomputed here."""
        seq = self.loading.pop(req_id)
        self.waiting.appendleft(seq)
        return seq

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.arrived or self.loading)


class DecodeEngine(Engine):
    def __init__(self, *args, make_worker: MakeWorker, on_retry: Callable[[Retry], None] | None = None,
                 max_retries: int = 1, **kwargs):
        """on_retry: asks the prefill side to send a failed transfer again (the launcher in a
        process); without it a failed transfer falls back at once."""
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler, DecodeScheduler):
            raise TypeError("DecodeEngine needs scheduler_class=DecodeScheduler")
        self.connector = self.scheduler.connector = ConnectorScheduler(self.kv_pool.block_size)
        self.worker = make_worker(self.kv_pool, self.model.config.num_layers)
        self.fallbacks: list[Fallback] = []
        self.retries: list[Retry] = []
        self.on_retry, self.max_retries = on_retry, max_retries
        self.loads: dict[int, OpenLoad] = {}             # req id -> its load, complete or not
        self.by_req: dict[int, Sequence] = {}

    def add_consumer(self, req_id: int, prompt_ids: list[int], params: SamplingParams, key: str) -> Sequence:
        cfg = self.model.config
        check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, params.max_tokens)
        seq = Sequence(list(prompt_ids), params)
        self.connector.register(seq, TransferParams(req_id, key, "consumer"))
        self.scheduler.add_consumer(seq)
        self.by_req[req_id] = seq
        return seq

    def advance_transfers(self, wait_s: float = 0.0) -> None:
        """Open the loads the scheduler planned, copy in what has landed, settle what ended."""
        self.scheduler.open_loads()
        meta = self.connector.build_connector_meta()
        self.worker.start_load_kv(meta)
        for spec in meta.loads:
            self.loads[spec.req_id] = self.worker.open[spec.req_id]
        done, failed = self.worker.progress(wait_s)
        for load in done:
            self.scheduler.load_done(load)
            self.worker.finished(load)
        for req_id, (load, reason) in failed.items():
            if self.on_retry is not None and load.attempts <= self.max_retries:
                self.retry_transfer(load, reason)
            else:
                self.fail_transfer(req_id, reason if load.attempts == 1 else f"{reason}, after a retry", load)

    def retry_transfer(self, load: OpenLoad, reason: str) -> None:
        """Before the fallback: keep the blocks and the layers already in, ask for the rest again."""
        retry = Retry(load.spec.req_id, reason, load.next_layer)
        self.worker.reopen(load)
        self.retries.append(retry)
        self.on_retry(retry)

    def fail_transfer(self, req_id: int, reason: str, load: OpenLoad | None = None) -> None:
        """The fallback: count it, say why, recompute the prompt locally."""
        load = load or self.worker.give_up(req_id)
        if load is None:                                   # loaded already, or not opened yet:
            seq = self.by_req.get(req_id)                  # then it must never be opened
            if seq is not None and seq in self.scheduler.arrived and seq.seq_id not in self.connector.consumed:
                self.connector.consumed.add(seq.seq_id)
                self.fallbacks.append(Fallback(req_id, reason, seq.num_prompt_tokens))
            return
        seq = self.scheduler.load_failed(req_id)
        self.fallbacks.append(Fallback(req_id, reason, seq.num_prompt_tokens - seq.num_computed_tokens))
        self.loads.pop(req_id, None)
        self.worker.finished(load)

    def step(self) -> list[Sequence]:
        self.advance_transfers()
        sampled = super().step()
        for seq in sampled:
            if seq.is_finished:
                params = self.connector.params.get(seq.seq_id)
                if params is not None:
                    self.by_req.pop(params.req_id, None)
                self.connector.request_finished(seq)
        return sampled

    def has_runnable(self) -> bool:
        """Work a step would do now (requests arrived or loading are not: they are waited on)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def has_transfers(self) -> bool:
        return bool(self.scheduler.arrived or self.scheduler.loading)


def build_pd_engine(model: nn.Module, role: str, make_worker: MakeWorker | None = None,
                    config: PagedSchedulerConfig | None = None, **kwargs) -> Engine:
    """role: "prefill", "decode" or "colocated" (lesson 16's CPU engine, no connector). All three
    use lesson 16's fast-path model, run eagerly (a layer hook needs an eager forward)."""
    if role == "colocated":
        return build_engine(model, config, use_graph=False, **kwargs)
    if make_worker is None:
        raise ValueError(f"a {role} engine needs make_worker (its connector's transport)")
    if role == "prefill":
        return build_engine(model, config, use_graph=False, engine_class=PrefillEngine, make_worker=make_worker,
                            **kwargs)
    if role == "decode":
        return build_engine(model, config, use_graph=False, engine_class=DecodeEngine, make_worker=make_worker,
                            scheduler_class=DecodeScheduler, **kwargs)
    raise ValueError(f"role must be 'prefill', 'decode' or 'colocated', got {role!r}")
