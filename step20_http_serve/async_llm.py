"""The async layer between HTTP handlers and the engine thread: text in, text deltas out.

Lesson 18's AsyncEngine streams token ids. A server needs more per request:

    prompt text --tokenizer--> ids --AsyncEngine--> token events (+ their logprobs)
                                                         |
    choice i of n  <-- Delta(text, finish_reason) <-- IncrementalDetokenizer (lesson 19):
                                                       safe text only, stop strings

  - n > 1 is n engine requests (params.child(i): seed + i), whose streams are merged into one
    stream of Deltas tagged with their choice index;
  - a stop string is found in text, not in tokens, so it is this layer that ends the request:
    leaving the token stream aborts it in the engine, which frees its KV blocks at once;
  - a consumer that stops listening (a client that hung up) cancels every stream below it,
    down to the engine: nothing keeps generating for nobody.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from step18_benchmark.faults import FaultPolicy
from step18_benchmark.frontend import AsyncEngine, TokenEvent
from step19_real_model.detokenizer import IncrementalDetokenizer
from step19_real_model.outputs import Logprob
from step19_real_model.params import SamplingParams
from step20_http_serve.metrics import ServerMetrics
from step20_http_serve.protocol import APIError


@dataclass
class Delta:
    """What one engine step added to one choice."""
    index: int                                  # the choice: prompt_index * n + i
    text: str                                   # may be "" (held back, or a special token)
    token_id: int
    logprobs: dict[int, Logprob] | None         # the token's entry when logprobs were asked for
    finish_reason: str | None = None            # "stop" | "length" on the choice's last Delta
    stop_reason: str | int | None = None        # the stop string or stop token id that ended it


class LogprobFrontEnd(AsyncEngine):
    """Lesson 18's front end, whose stream also hands out each token's logprobs entry.

    The engine appends `seq.logprobs[k]` (lesson 19) before the k-th token's event is posted,
    so the consumer can read it from the Sequence; all this subclass adds is a way to find the
    Sequence: the request record of each "add", keyed by its (per-request) params object."""

    def __init__(self, engine, threaded: bool = True, **front_options):
        self._adds: dict[int, object] = {}       # id(params) -> lesson 18's request record
        super().__init__(engine, threaded, **front_options)

    def _post(self, kind: str, req) -> None:
        if kind == "add" and id(req.params) in self._adds:   # a request that stream() started
            self._adds[id(req.params)] = req
        super()._post(kind, req)

    async def stream(self, prompt_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[tuple[TokenEvent, dict[int, Logprob] | None]]:
        """params must be an object no other live request uses (params.child(i) makes one)."""
        key, k = id(params), 0
        self._adds[key] = None
        events = self.generate(prompt_ids, params)
        try:
            async for event in events:
                req = self._adds.get(key)
                entries = getattr(getattr(req, "seq", None), "logprobs", None)
                wanted = getattr(params, "logprobs", None) is not None   # lesson 06's params have none
                entry = entries[k] if wanted and entries and k < len(entries) else None
                k += 1
                yield event, entry
        finally:
            self._adds.pop(key, None)
            await events.aclose()          # leaving early posts the abort now, not at GC time


class AsyncLLM:
    """Lesson 19's LLM (tokenizer, chat template, engine) served to many concurrent callers."""

    def __init__(self, llm, served_model_name: str | None = None, threaded: bool = True,
                 policy: FaultPolicy | None = None):
        """threaded=False: the engine loop runs where `serve` calls `front.drive` (the main
        thread), uvicorn in a helper thread (lesson 18's thread_cost.py says why).
        policy: when step faults stop being isolated (lesson 18's faults.py)."""
        self.llm, self.tokenizer = llm, llm.tokenizer
        self.model_name = served_model_name or str(llm.model_dir)
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.engine.model.config.vocab_size
        self.metrics = ServerMetrics(llm.engine, self.model_name)
        self.front = LogprobFrontEnd(llm.engine, threaded, policy=policy)
        self._token_texts: dict[int, str] = {}

    def shutdown(self) -> None:
        self.front.shutdown()

    @property
    def healthy(self) -> bool:
        thread = self.front._thread                 # None: driven from the main thread
        return self.front.error is None and (thread is None or thread.is_alive())

    # ---- prompts ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.llm.encode(text) if hasattr(self.llm, "encode") else self.tokenizer.encode(text)

    def chat_ids(self, messages: list[dict], chat_template_kwargs: dict | None) -> list[int]:
        try:
            return self.llm.chat_prompt_ids(messages, chat_template_kwargs=chat_template_kwargs)
        except (ValueError, TypeError, KeyError) as e:   # the template's own complaints, too
            raise APIError(f"messages: {e}", "messages") from e

    def check_prompt(self, ids: list[int], max_tokens: int | None, field: str) -> int:
        """Refuse what the engine could never serve, naming the field; return max_tokens
        (None: up to the end of the context, as vLLM does)."""
        if not ids:
            raise APIError(f"{field}: is empty; at least one token is needed", field)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"{field}: token id {bad} is out of the vocabulary [0, {self.vocab_size})", field)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise APIError(f"{field}: {len(ids)} tokens; this model's maximum context length is "
                           f"{self.max_model_len} tokens, with room for at least one more",
                           field, code="context_length_exceeded")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(f"max_tokens: this model's maximum context length is {self.max_model_len} tokens; "
                           f"you asked for {len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} "
                           f"to generate)", "max_tokens", code="context_length_exceeded")
        return max_tokens

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (half a UTF-8 character decodes to U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- generation ------------------------------------------------------------------------
    def generate(self, requests: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[Delta]:
        """Every choice of every prompt (n per prompt), merged; choice index = prompt * n + i."""
        streams = [self._choice(p * sp.n + i, ids, sp.child(i))
                   for p, (ids, sp) in enumerate(requests) for i in range(sp.n)]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def _choice(self, index: int, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        arrival, times = time.perf_counter(), []
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
        async for event, entry in self.front.stream(prompt_ids, params):
            times.append(event.time)
            text = detok.add(event.token_id)
            delta = Delta(index, text, event.token_id, entry)
            if detok.stop_string is not None:          # ends here; leaving the stream aborts it
                delta.finish_reason, delta.stop_reason = "stop", detok.stop_string
            elif event.finished:
                delta.finish_reason = event.finish_reason
                if event.finish_reason == "stop" and event.token_id in params.stop_token_ids:
                    delta.stop_reason = event.token_id
            if delta.finish_reason is not None:
                delta.text += detok.flush()
                self.metrics.observe(arrival, times, time.perf_counter(), delta.finish_reason)
                yield delta
                return
            yield delta


_END = object()


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Items of several streams as they come. Closing the merged stream (or an error in one)
    cancels the others, which aborts their engine requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Delta]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
