"""Deltas -> OpenAI's JSON: streamed chunks and whole responses, for completions and chat.

    completions   {"id": "cmpl-..", "object": "text_completion", "choices": [{"index", "text",
                  "logprobs": {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
                  "finish_reason", "stop_reason"}], "usage": {...}}        (chunks: the same shape)
    chat          {"id": "chatcmpl-..", "object": "chat.completion", "choices": [{"index",
                  "message": {"role": "assistant", "content"}, "logprobs": {"content": [{"token",
                  "logprob", "bytes", "top_logprobs": [...]}]}, "finish_reason"}], "usage": {...}}
                  chunks: "object": "chat.completion.chunk", "delta" instead of "message", the
                  first chunk of each choice carries the role
One renderer serves one HTTP request; it also keeps the running totals for `usage`.
"""
from __future__ import annotations

import time
import uuid
from collections import defaultdict

from step20_http_serve.async_llm import AsyncLLM, Delta


class Renderer:
    object_name = ""
    id_prefix = ""

    def __init__(self, llm: AsyncLLM, num_choices: int, prompt_tokens: int, include_usage: bool,
                 top_logprobs: int | None):
        self.llm, self.num_choices, self.include_usage = llm, num_choices, include_usage
        self.top_logprobs = top_logprobs           # None: no logprobs; k: the top k besides the chosen
        self.id, self.created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        self.prompt_tokens = prompt_tokens         # once per prompt, not once per choice (OpenAI)
        self.tokens = [0] * num_choices
        self.texts: dict[int, list[str]] = defaultdict(list)
        self.logprobs: dict[int, list] = defaultdict(list)
        self.ends: dict[int, tuple[str | None, str | int | None]] = {}
        self.offsets = [0] * num_choices           # characters so far, for text_offset

    def usage(self) -> dict:
        done = sum(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def head(self, chunk: bool) -> dict:
        name = self.object_name + (".chunk" if chunk and self.object_name == "chat.completion" else "")
        return {"id": self.id, "object": name, "created": self.created, "model": self.llm.model_name}

    # ---- streaming -------------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        return []

    def chunk(self, d: Delta) -> dict | None:
        """The chunk for one Delta, or None when it has nothing a client can see."""
        self.tokens[d.index] += 1
        logprobs = self.format_logprobs(d)
        if not d.text and d.finish_reason is None and logprobs is None:
            return None
        return self.stream_chunk([self.choice_chunk(d, logprobs)])

    def stream_chunk(self, choices: list[dict]) -> dict:
        out = self.head(chunk=True) | {"choices": choices}
        if self.include_usage:
            out["usage"] = None                    # OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self) -> dict:
        return self.head(chunk=True) | {"choices": [], "usage": self.usage()}

    # ---- whole response --------------------------------------------------------------------
    def add(self, d: Delta) -> None:
        self.tokens[d.index] += 1
        self.texts[d.index].append(d.text)
        logprobs = self.format_logprobs(d)
        if logprobs is not None:
            self.logprobs[d.index].append(logprobs)
        if d.finish_reason is not None:
            self.ends[d.index] = (d.finish_reason, d.stop_reason)

    def response(self) -> dict:
        choices = [self.choice(i, "".join(self.texts[i]), *self.ends.get(i, (None, None)))
                   for i in range(self.num_choices)]
        return self.head(chunk=False) | {"choices": choices, "usage": self.usage()}

    # ---- shapes that differ ----------------------------------------------------------------
    def format_logprobs(self, d: Delta):
        raise NotImplementedError

    def choice_chunk(self, d: Delta, logprobs) -> dict:
        raise NotImplementedError

    def choice(self, i: int, text: str, finish_reason, stop_reason) -> dict:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object_name, id_prefix = "text_completion", "cmpl"

    def format_logprobs(self, d: Delta) -> dict | None:
        if self.top_logprobs is None or d.logprobs is None:
            return None
        token = self.llm.token_text(d.token_id)
        chosen = d.logprobs.get(d.token_id)
        offset, self.offsets[d.index] = self.offsets[d.index], self.offsets[d.index] + len(token)
        return {"tokens": [token], "token_logprobs": [chosen.logprob if chosen else None],
                "top_logprobs": [{self.llm.token_text(t): lp.logprob for t, lp in d.logprobs.items()}],
                "text_offset": [offset]}

    def choice_chunk(self, d: Delta, logprobs) -> dict:
        return {"index": d.index, "text": d.text, "logprobs": logprobs,
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def choice(self, i: int, text: str, finish_reason, stop_reason) -> dict:
        parts = self.logprobs.get(i)
        logprobs = None if not parts else {k: [x for p in parts for x in p[k]] for k in parts[0]}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


class ChatRenderer(Renderer):
    object_name, id_prefix = "chat.completion", "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.llm.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def format_logprobs(self, d: Delta) -> dict | None:
        if self.top_logprobs is None or d.logprobs is None:
            return None
        chosen = d.logprobs.get(d.token_id)
        top = sorted((lp.rank, t, lp.logprob) for t, lp in d.logprobs.items() if lp.rank <= self.top_logprobs)
        entry = self._entry(d.token_id, chosen.logprob if chosen else None)
        entry["top_logprobs"] = [self._entry(t, lp) for _, t, lp in top]
        return {"content": [entry]}

    def opening_chunks(self) -> list[dict]:
        return [self.stream_chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])
                for i in range(self.num_choices)]

    def choice_chunk(self, d: Delta, logprobs) -> dict:
        return {"index": d.index, "delta": {"content": d.text} if d.text else {}, "logprobs": logprobs,
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def choice(self, i: int, text: str, finish_reason, stop_reason) -> dict:
        parts = self.logprobs.get(i)
        logprobs = None if not parts else {"content": [e for p in parts for e in p["content"]]}
        return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason}
