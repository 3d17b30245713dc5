"""Lesson 19's `LLM` with vLLM's LoRA arguments:

    llm = LoRALLM(folder, max_loras=4, max_lora_rank=16)
    sql = LoRARequest("sql", 1, "/adapters/sql")                 # a PEFT folder
    outs = llm.generate(prompts, SamplingParams(max_tokens=32), lora_request=sql)         # all prompts
    outs = llm.generate(prompts, params, lora_request=[sql, None, french])                # one per prompt

The adapter rides to the engine inside each request's SamplingParams (LoRASamplingParams: lesson
19's, plus `lora_request`), because lesson 19's LLM hands the engine (ids, params) and nothing
else; `params.child(i)` copies it to each of the n completions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence as Seq

from step04_transformer.loader import load_model
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams

from .adapters import LoRARequest
from .engine import LoRAEngine, build_lora_engine

LoRAArg = LoRARequest | Seq[LoRARequest | None] | None


@dataclass
class LoRASamplingParams(SamplingParams):
    lora_request: LoRARequest | None = None

    @classmethod
    def of(cls, params: SamplingParams, lora_request: LoRARequest | None) -> "LoRASamplingParams":
        """`params` (lesson 19's fields) with the adapter attached (None: the one `params` carries, if any)."""
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
        return cls(**fields, lora_request=lora_request or getattr(params, "lora_request", None))


class LoRALLM(LLM):
    engine: LoRAEngine

    def __init__(self, model: str | None = None, *, max_loras: int = 4, max_lora_rank: int = 16,
                 lora_strategy: str = "auto", dtype: str = "auto", max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20):
        """max_loras: adapters resident at once (vLLM's --max-loras); max_lora_rank: the largest
        rank accepted (slots are sized for it); lora_strategy: lora_linear.py's segments / stacked / auto."""
        self._lora_options = dict(max_loras=max_loras, max_lora_rank=max_lora_rank, lora_strategy=lora_strategy)
        super().__init__(model, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         kv_cache_bytes=kv_cache_bytes, enforce_eager=True)
        bm = self.engine.scheduler.block_manager
        self.max_model_len = min(self.engine.model.config.max_position_embeddings, bm.num_blocks * bm.block_size)
        self._lora: LoRAArg = None

    def make_engine(self, *, max_num_seqs: int, max_num_batched_tokens: int, kv_cache_bytes: int,
                    **_lesson19_only) -> LoRAEngine:
        """Lesson 19's hook: this lesson's engine (lesson 15's parts with LoRA linears) instead of
        lesson 16's fast path; tensor parallelism and graph capture are not part of it."""
        config = PagedSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      kv_cache_bytes=kv_cache_bytes)
        return build_lora_engine(load_model(self.model_dir, self.dtype), config, **self._lora_options)

    def register_lora(self, request: LoRARequest) -> None:
        """Check an adapter folder now (a server does this at start) instead of at its first request."""
        self.engine.loras.register(request)

    def generate(self, prompts: Any, sampling_params=None, *, use_tqdm: bool = True,
                 lora_request: LoRAArg = None):
        """Lesson 19's generate; lora_request: one adapter for every prompt, or one (or None) per prompt."""
        self._lora = lora_request
        try:
            return super().generate(prompts, sampling_params, use_tqdm=use_tqdm)
        finally:
            self._lora = None

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True, chat_template_kwargs=None,
             lora_request: LoRAArg = None):
        self._lora = lora_request
        try:
            return super().chat(messages, sampling_params, use_tqdm=use_tqdm, chat_template_kwargs=chat_template_kwargs)
        finally:
            self._lora = None

    def _params(self, sp, count: int) -> list[SamplingParams]:
        """Lesson 19's checks, then each prompt's adapter checked and attached to its params."""
        plist = super()._params(sp, count)
        loras = list(self._lora) if isinstance(self._lora, (list, tuple)) else [self._lora] * count
        if len(loras) != count:
            raise ValueError(f"got {len(loras)} lora_requests for {count} prompts")
        for i, lr in enumerate(loras):
            if lr is not None:
                try:
                    self.register_lora(lr)         # a bad folder fails here, before any request runs
                except (ValueError, TypeError, FileNotFoundError) as e:
                    raise type(e)(f"prompt {i}: {e}") from None
        return [LoRASamplingParams.of(p, lr) for p, lr in zip(plist, loras)]

    def lora_stats(self):
        return self.engine.loras.stats()
