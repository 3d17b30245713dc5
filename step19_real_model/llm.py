"""`LLM`: the offline API of vLLM, over this tutorial's engine.

    llm = LLM()                                   # the embedded SmolLM2 (or a folder, or Qwen3-0.6B)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Why is the sky blue?"}], SamplingParams(max_tokens=64))
    print(outs[0].outputs[0].text)

    prompts --tokenizer--> ids --+--> engine.add_request(ids, params.child(i))   i < n
    messages --chat template--'        |  step() until every request is done
                                       v
    tokens --IncrementalDetokenizer--> text, stop strings --> RequestOutput per prompt

A stop string is found in the text, above the engine, so the LLM ends that request itself:
lesson 18's abort() frees its KV blocks at once. Bad input fails before anything reaches the
engine, with the prompt's index in the message; an error or Ctrl-C during the run aborts what
is still running, so the engine is empty again afterwards.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence as Seq

import torch
from tqdm.auto import tqdm

from minivllm_support.cpu import auto_dtype
from minivllm_support.models import load_tokenizer, resolve_model
from step05_naive.generate import check_prompt
from step09_continuous_batching.sequence import Sequence
from step18_benchmark.frontend import abort
from step19_real_model.detokenizer import IncrementalDetokenizer
from step19_real_model.engine import LogprobsEngine, build_engine
from step19_real_model.outputs import CompletionOutput, RequestMetrics, RequestOutput
from step19_real_model.params import SamplingParams

# "auto": bf16 where the CPU computes bf16 natively (AVX-512 BF16, AMX), else float32
# (minivllm_support/cpu.py); vLLM's CPU backend also picks by what the CPU supports.
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class _Tracked:
    output: RequestOutput
    index: int
    detok: IncrementalDetokenizer


class LLM:
    def __init__(self, model: str | Path | None = None, *, dtype: str | torch.dtype = "auto",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_bytes: int = 512 * 2**20,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, launch=None):
        """model: a local Hugging Face folder; None finds one (MINIVLLM_MODEL, a cached Qwen3-0.6B,
        else the embedded SmolLM2-135M-Instruct). Weights never come from a hub. launch: where
        the tensor-parallel ranks run (lesson 17's launch.NodeLaunch; default: this machine)."""
        if isinstance(dtype, str) and dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of {['auto', *sorted(DTYPES)]} or a torch dtype, got {dtype!r}")
        self.dtype = auto_dtype() if dtype == "auto" else DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.model_dir = resolve_model(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        torch.set_grad_enabled(False)
        self.engine: LogprobsEngine = self.make_engine(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, kv_cache_bytes=kv_cache_bytes,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager, launch=launch)
        cfg, bm = self.engine.model.config, self.engine.scheduler.block_manager
        # The longest sequence this engine can hold: the model's positions, or the KV pool
        # (less the block lesson 16 keeps for padded rows), whichever is shorter.
        self.max_model_len = min(cfg.max_position_embeddings, (bm.num_blocks - 1) * bm.block_size)
        self.vocab_size = cfg.vocab_size
        self._request_ids = itertools.count()

    def make_engine(self, **limits) -> LogprobsEngine:
        """The engine for self.model_dir and self.dtype (engine.py's build_engine); an advanced
        lesson's LLM overrides this to serve with its own engine, built once."""
        return build_engine(self.model_dir, self.dtype, **limits)

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def render_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
        return render_chat(self.tokenizer, messages, chat_template_kwargs)

    def chat_prompt_ids(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, chat_template_kwargs), add_special_tokens=False)

    # ---- the two entry points --------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, {"prompt": ...} or {"prompt_token_ids": ...},
        or a list of those. One RequestOutput per prompt, in the order given."""
        if isinstance(prompts, (str, dict)) or _is_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be text, token ids or a list of them, got {type(prompts).__name__}")
        items = [self._prompt(i, p) for i, p in enumerate(prompts)]
        return self._run(items, self._params(sampling_params, len(items)), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             *, use_tqdm: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                             "(or a list of such conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        items = []
        for i, conv in enumerate(conversations):
            try:
                text = self.render_chat(conv, chat_template_kwargs)
            except (ValueError, TypeError) as e:
                raise type(e)(f"conversation {i}: {e}") from None
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, self._params(sampling_params, len(items)), use_tqdm)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- checks ----------------------------------------------------------------------------
    def _prompt(self, i: int, p: Any) -> tuple[str | None, list[int]]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                text, ids = p.get("prompt"), p["prompt_token_ids"]
            elif "prompt" in p:
                text, ids = p["prompt"], None
            else:
                raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            text, ids = (p, None) if isinstance(p, str) else (None, p)
        if ids is None:
            if not isinstance(text, str):
                raise TypeError(f"prompt {i}: expected text or a list of token ids, got {type(text).__name__}")
            ids = self.encode(text)
        if not _is_ids(ids):
            raise TypeError(f"prompt {i}: token ids must be a non-empty list of ints, got {str(ids)[:60]}")
        return text, [int(t) for t in ids]

    def _params(self, sp: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
        plist = list(sp) if isinstance(sp, (list, tuple)) else [sp or SamplingParams()] * count
        if len(plist) != count:
            raise ValueError(f"got {len(plist)} SamplingParams for {count} prompts")
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise TypeError("sampling_params must be step19_real_model.SamplingParams "
                                f"(it carries n, stop and logprobs), got {type(p).__name__}")
        return plist

    # ---- the run ---------------------------------------------------------------------------
    def _run(self, items: list[tuple[str | None, list[int]]], plist: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        for i, ((_, ids), sp) in enumerate(zip(items, plist)):
            try:                           # lesson 05's checks, against what this engine can hold
                check_prompt(ids, self.vocab_size, self.max_model_len, sp.max_tokens)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e} (max_model_len {self.max_model_len})") from None
        outputs = [RequestOutput(str(next(self._request_ids)), text, ids, [None] * sp.n)
                   for (text, ids), sp in zip(items, plist)]
        live: dict[Sequence, _Tracked] = {}
        bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            for out, sp in zip(outputs, plist):
                for i in range(sp.n):
                    seq = self.engine.add_request(out.prompt_token_ids, sp.child(i))
                    live[seq] = _Tracked(out, i, IncrementalDetokenizer(self.tokenizer, out.prompt_token_ids,
                                                                        seq.params))
            while live:
                if not self.engine.has_unfinished():
                    raise RuntimeError("the engine has no work left but requests are unfinished")
                for seq in self.engine.step():
                    t = live.get(seq)
                    if t is None:
                        continue
                    generated += 1
                    t.detok.add(seq.token_ids[-1])
                    if t.detok.stop_string is not None and not seq.is_finished:
                        abort(self.engine, seq)                 # frees its KV blocks now
                    if seq.is_finished:
                        del live[seq]
                        t.output.outputs[t.index] = self._completion(seq, t)
                        if t.output.finished:
                            bar.update(1)
                            bar.set_postfix_str(f"output {generated / (time.perf_counter() - start):.1f} tok/s",
                                                refresh=False)
        finally:
            for seq in live:                 # an error or Ctrl-C: nothing stays in the engine
                abort(self.engine, seq)
            bar.close()
        return outputs

    def _completion(self, seq: Sequence, t: _Tracked) -> CompletionOutput:
        t.detok.flush()
        token_ids = list(seq.output_token_ids)
        stop_string = t.detok.stop_string
        reason = "stop" if stop_string is not None else seq.finish_reason
        stop_reason = stop_string
        if stop_string is None and reason == "stop" and token_ids[-1] in seq.params.stop_token_ids:
            stop_reason = token_ids[-1]
        logprobs, cumulative = seq.logprobs, None
        if logprobs is not None:
            for entry in logprobs:
                for tid, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([tid])
            cumulative = sum(entry[tok].logprob for entry, tok in zip(logprobs, token_ids))
        times = seq.token_times
        metrics = RequestMetrics(seq.arrival_time, times[0] if times else None, times[-1] if times else None,
                                 seq.num_preemptions)
        return CompletionOutput(t.index, t.detok.output_text, token_ids, reason, stop_reason, cumulative,
                                logprobs, metrics)


def _is_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in x)


def render_chat(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
    """The conversation as the checkpoint's chat template writes it, ready for the assistant's
    turn. chat_template_kwargs go to the template: Qwen3's {"enable_thinking": False} makes it
    open the answer with an empty <think></think>, so the model answers without reasoning first."""
    check_messages(messages)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))


def check_messages(messages: Any) -> None:
    """A conversation the chat template can render; the error names the message and field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
            raise TypeError(f"messages[{i}].content must be a string, got {type(content).__name__}")
