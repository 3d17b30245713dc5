"""Lesson 20's OpenAI-compatible server, unchanged, on top of N replicas.

    HTTP --> lesson 20's app (api.py) --> DPAsyncLLM --> DPFrontEnd --> replica 0 | replica 1 | ...
             /v1/completions, /v1/chat     |  tokenizer, chat template,
             /health, /metrics             |  detokenizer, stop strings: here, in the front process

AsyncLLM (lesson 20) needs four things of what it wraps: a tokenizer and chat template (the
`llm` object), the model's limits, a `front` with `stream()`, and an engine whose stats()
/metrics reads. Here the front is the DPFrontEnd, the stats are the replicas' summed, and the
`llm` is just the tokenizer side of lesson 19's LLM: the front process loads no weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from advanced.adv08_data_parallel.frontend import DPFrontEnd
from minivllm_support.models import load_tokenizer
from step04_transformer.config import ModelConfig
from step17_tensor_parallel.launch import NodeLaunch
from step19_real_model.llm import render_chat
from step20_http_serve.api import build_app
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.metrics import ServerMetrics


@dataclass
class Tokenizing:
    """What AsyncLLM and the API read of lesson 19's LLM, without its engine."""
    model_dir: Path
    tokenizer: object

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_prompt_ids(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
        return self.tokenizer.encode(render_chat(self.tokenizer, messages, chat_template_kwargs),
                                     add_special_tokens=False)


class DPAsyncLLM(AsyncLLM):
    """Lesson 20's AsyncLLM whose requests go to a DPFrontEnd instead of an in-process engine."""

    def __init__(self, front: DPFrontEnd, served_model_name: str | None = None):
        # AsyncLLM.__init__ would build an engine front of its own: set what it sets, by hand.
        self.llm = Tokenizing(front.model_dir, load_tokenizer(front.model_dir))
        self.tokenizer = self.llm.tokenizer
        self.model_name = served_model_name or str(front.model_dir)
        cfg = ModelConfig.from_pretrained(front.model_dir)
        pool_tokens = min((f["num_blocks"] - 1) * f["block_size"] for f in front.facts)
        self.max_model_len = min(cfg.max_position_embeddings, pool_tokens)   # the smallest replica's
        self.vocab_size = cfg.vocab_size
        self.metrics = ServerMetrics(front, self.model_name)
        self.front = front
        self._token_texts: dict[int, str] = {}


def build_dp_server(model: str | None = None, *, num_replicas: int = 2, policy: str = "cache_aware",
                    served_model_name: str | None = None, dtype: torch.dtype = torch.float32,
                    max_body_bytes: int = 16 * 2**20, launch: NodeLaunch | None = None, **front_options):
    """(the FastAPI app, its DPAsyncLLM); call the DPAsyncLLM's shutdown() when done serving.
    launch: this is node 0 of launch.nnodes (the others run advanced.adv08_data_parallel.node).
    front_options: DPFrontEnd's (threads_per_replica, kv_cache_bytes, hang_timeout_s, router options)."""
    front = DPFrontEnd(model, num_replicas, policy, dtype=dtype, launch=launch, **front_options)
    try:
        llm = DPAsyncLLM(front, served_model_name)
    except BaseException:
        front.close()
        raise
    return build_app(llm, max_body_bytes=max_body_bytes), llm
