"""Token ids in, text out, one token at a time: what a streaming server sends after each step.

Decoding each new token on its own is wrong in two ways:
  - a character can span tokens: byte-level BPE splits an emoji or a Chinese character into
    bytes, and the first token alone decodes to U+FFFD ("half a character");
  - how a token reads can depend on the token before it (SentencePiece's leading space).
So, like vLLM, decode a short window that ends with the new tokens, together with a few tokens
of context before them, and hand out only what the new tokens added:

    ids:   ... [ context | new ]          text(context + new) - text(context) = the delta
                 ^prefix   ^read          (nothing yet if it ends in U+FFFD: wait for the rest)

Stop strings are found in the text, where they can span tokens ("Hel" + "lo" makes "Hello").
Text that could be the start of a stop string is held back (the last len(longest stop) - 1
characters), so a client never sees a piece of text that later turns out to be cut.
Once a stop string is found, the text is cut before it (or after it, with
include_stop_str_in_output), `stop_string` names it, and the request should end.
A token that ends the request by itself (a stop token id, or EOS) adds no text unless
include_stop_str_in_output asks for it, as in vLLM.
"""
from __future__ import annotations

from typing import Sequence

from step19_real_model.params import SamplingParams

PROMPT_CONTEXT = 5       # prompt tokens decoded with the first output tokens (vLLM uses 5 too)
REPLACEMENT = "\ufffd"   # what a decoder gives for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.stops: list[str] = list(params.stop or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.terminal_ids = set(params.stop_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and not params.ignore_eos:
            self.terminal_ids.add(eos)
        self.ids: list[int] = [int(t) for t in prompt_ids[-PROMPT_CONTEXT:]]
        self.prefix_offset = 0             # the window starts here: context only
        self.read_offset = len(self.ids)   # tokens before this are in self.text
        self.text = ""                     # complete characters so far (cut at a stop string)
        self.emitted = 0                   # characters of self.text already handed out
        self.stop_string: str | None = None
        self.token_ids: list[int] = []     # every output token, text or not

    @property
    def output_text(self) -> str:
        return self.text

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text that is now safe to show (maybe "")."""
        if self.stop_string is not None:
            raise RuntimeError("a stop string already ended this completion")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if token_id in self.terminal_ids and not self.params.include_stop_str_in_output:
            return ""                      # it ends the request; its text is not part of the output
        self.ids.append(token_id)
        self._append(self._decode_window(final=False))
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: everything still held back (and an incomplete character
        at the very end, as U+FFFD, which is what a full decode gives too)."""
        if self.stop_string is None:
            self._append(self._decode_window(final=True))
        return self._release(final=True)

    # ---- the parts -------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_window(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""                      # a special token skipped, or half a character: wait
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def _append(self, new: str) -> None:
        if not new:
            return
        start = max(0, len(self.text) - self.hold)     # a stop string may begin in held-back text
        self.text += new
        found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if found:
            i, s = min(found)                           # the earliest one wins
            self.stop_string = s
            self.text = self.text[:i + (len(s) if self.params.include_stop_str_in_output else 0)]

    def _release(self, final: bool) -> str:
        safe = len(self.text) if final or self.stop_string is not None else len(self.text) - self.hold
        if safe <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:safe], safe
        return out
