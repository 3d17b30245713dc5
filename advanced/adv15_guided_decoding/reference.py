"""The libraries people use, behind this lesson's GuideState interface: allowed() / accept(token).

    xgrammar    (vLLM's and SGLang's default)  TokenizerInfo -> GrammarCompiler -> GrammarMatcher
    llguidance  (vLLM's "guidance" backend)    LLTokenizer -> LLMatcher(grammar)

Both give the mask as a packed bitmask, int32 words of 32 tokens, bit i of word w = token
32 * w + i; `unpack` turns it into the bool [V] mask our index computes, so the three can be
compared token for token (tests) and timed on the same states (run.py).

What they allow differently from us, by design:
  - llguidance refuses a token when a longer token spells the same forced text: where the
    grammar forces '{"', it offers the token '{"' and not '{' (the tokenizer would never produce
    '{' followed by '"' there: "canonical" tokenizations only). Its set is a subset of ours.
  - llguidance reads \\d as any Unicode digit (so it allows the first byte of '٣'); ours and
    xgrammar's \\d is [0-9]. The tests write [0-9].
  - for JSON schemas both libraries accept whitespace between tokens (as JSON does) unless told
    otherwise; our schema regex is compact JSON. The differential tests compare regexes.
"""
from __future__ import annotations

import numpy as np
import torch


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [ceil(V / 32)] bitmask -> bool [V] (bit order: little, as both libraries lay it out)."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab_size].astype(bool))


class XgrammarGuide:
    """One request under xgrammar; `info` is built once per tokenizer (xgrammar_compiler)."""

    def __init__(self, compiler, regex: str, vocab_size: int):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiler.compile_regex(regex))
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def fill(self) -> torch.Tensor:
        """The packed mask (what an engine would hand to its kernel)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask

    def allowed(self) -> torch.Tensor:
        return unpack(self.fill()[0], self.vocab_size)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")


def xgrammar_compiler(tokenizer, vocab_size: int, eos_ids: list[int]):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class LLGuidanceGuide:
    """One request under llguidance; `lltok` is built once per tokenizer (llguidance_tokenizer)."""

    def __init__(self, lltok, regex: str, vocab_size: int):
        import llguidance
        import llguidance.torch as lgt
        self.matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex(regex))
        if self.matcher.is_error():
            raise ValueError(f"llguidance: {self.matcher.get_error()}")
        self.bitmask = lgt.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def fill(self) -> torch.Tensor:
        import llguidance.torch as lgt
        lgt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        return self.bitmask

    def allowed(self) -> torch.Tensor:
        return unpack(self.fill()[0], self.vocab_size)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {self.matcher.get_error()}")


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_ids: list[int]):
    import llguidance.hf
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids[0])
