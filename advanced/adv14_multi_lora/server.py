"""Lesson 20's OpenAI-compatible server with LoRA adapters as models, as `vllm serve` does:

    python -m advanced.adv14_multi_lora.server --model PATH --lora-modules sql=/a/sql french=/a/french \\
           --max-loras 2 --port 8000          (then lesson 20's flags)

    GET  /v1/models             the base model and every adapter (its "parent" is the base)
    POST /v1/completions        {"model": "sql", ...}: this request runs with the adapter "sql";
    POST /v1/chat/completions   {"model": <the base's name>} or no model: the base alone;
                                any other name: 404 naming the model and what is served

Adapters are registered (their folders read and checked) when the server starts, so a bad
folder stops the start with the reason instead of failing a request later. Everything else is
lesson 20's: its routes and errors, its async layer, its flags; the request classes add the
adapter (a validator turns `model: "sql"` into the adapter) and /v1/models is replaced.
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import ClassVar

from fastapi import FastAPI
from pydantic import BaseModel, PrivateAttr, model_validator

from step18_benchmark.faults import FaultPolicy
from step20_http_serve import protocol
from step20_http_serve.__main__ import main as lesson20_main
from step20_http_serve.api import build_app
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.protocol import APIError
from step20_http_serve.server import arm_fault_marker

from .adapters import LoRARequest
from .llm import LoRALLM, LoRASamplingParams


class LoRAFields(BaseModel):
    """Put first among the bases: `model` may name an adapter of this server."""
    adapters: ClassVar[dict[str, LoRARequest]] = {}
    base_name: ClassVar[str] = ""
    _lora: LoRARequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _adapter(self):
        if self.model is None or self.model == self.base_name:
            return self
        if self.model not in self.adapters:
            served = ", ".join(f"`{n}`" for n in [self.base_name, *self.adapters])
            raise APIError(f"model: the model `{self.model}` does not exist (this server serves {served})",
                           "model", status=404, code="model_not_found")
        self._lora = self.adapters[self.model]
        self.model = None           # lesson 20's check then sees a request for the served model
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> LoRASamplingParams:
        return LoRASamplingParams.of(super().sampling_params(max_tokens, logprobs), self._lora)


def request_classes(base_name: str, adapters: dict[str, LoRARequest]) -> tuple[type, type]:
    """Completion and chat request classes that know this server's adapters."""
    names = {"adapters": dict(adapters), "base_name": base_name}
    return (type("CompletionRequest", (LoRAFields, protocol.CompletionRequest), names),
            type("ChatCompletionRequest", (LoRAFields, protocol.ChatCompletionRequest), names))


def replace_models_route(app: FastAPI, llm: AsyncLLM, adapters: dict[str, LoRARequest]) -> None:
    """/v1/models lists the base, then each adapter with the base as its parent (vLLM's shape)."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/models"]

    @app.get("/v1/models")
    async def models() -> dict:
        base = {"id": llm.model_name, "object": "model", "created": 0, "owned_by": "mini-vllm",
                "root": str(llm.llm.model_dir), "parent": None, "max_model_len": llm.max_model_len}
        cards = [base] + [{**base, "id": name, "root": lr.lora_path, "parent": llm.model_name}
                          for name, lr in adapters.items()]
        return {"object": "list", "data": cards}


def build_server(model: str | None = None, *, lora_modules: dict[str, str] | None = None, max_loras: int = 4,
                 max_lora_rank: int = 16, served_model_name: str | None = None, dtype: str = "auto",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 enforce_eager: bool = True, max_body_bytes: int = 16 * 2**20, threaded: bool = True,
                 fault_marker: str | None = None, policy: FaultPolicy | None = None,
                 tensor_parallel_size: int = 1, launch=None):
    """Lesson 20's build_server with a LoRALLM and the adapters {name: folder}: (app, AsyncLLM).
    The LoRA engine is always eager (engine.py) and runs in one process."""
    if tensor_parallel_size != 1:
        raise ValueError("the LoRA engine runs in one process: tensor_parallel_size must be 1")
    llm = LoRALLM(model, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, kv_cache_bytes=kv_cache_bytes)
    adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate((lora_modules or {}).items())}
    try:
        base_name = served_model_name or str(llm.model_dir)      # what lesson 20's AsyncLLM will call it
        if base_name in adapters:
            raise ValueError(f"--lora-modules: {base_name!r} is the base model's name")
        for lr in adapters.values():
            llm.register_lora(lr)                                # a bad folder stops the start here
    except BaseException:
        llm.close()
        raise
    arm_fault_marker(llm, fault_marker)
    engine = AsyncLLM(llm, served_model_name, threaded, policy)
    completion, chat = request_classes(engine.model_name, adapters)
    app = build_app(engine, max_body_bytes=max_body_bytes, completion_request=completion, chat_request=chat)
    replace_models_route(app, engine, adapters)
    return app, engine


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    modules = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {item!r} is not name=path")
        if name in modules:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    return modules


def main(argv: list[str] | None = None) -> None:
    """This lesson's three flags; everything else goes to lesson 20's main."""
    p = argparse.ArgumentParser(prog="python -m advanced.adv14_multi_lora.server", add_help=False)
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters served as models")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident at once (LRU slots)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    args, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(p.format_help())
    try:
        modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        p.error(str(e))
    lesson20_main(rest, build=functools.partial(build_server, lora_modules=modules, max_loras=args.max_loras,
                                                max_lora_rank=args.max_lora_rank))


if __name__ == "__main__":
    main(sys.argv[1:])
