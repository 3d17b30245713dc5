"""From a byte-level DFA to token masks: which token ids may come next in each DFA state.

    vocabulary: id -> bytes   ("Ġcat" is b" cat"; <|im_end|> is special: no bytes)
    allowed(state) = { t : walking bytes(t) from state never hits DEAD }  +  EOS if state accepts
    advance(state, t) = the state after walking bytes(t)

Why one mask per DFA state is exact: the DFA state IS everything the constraint remembers about
the text so far, so two prefixes that end in the same state allow exactly the same tokens. The
masks are computed lazily (a request only ever visits a few states) and cached on the index,
which every request with the same pattern shares.

A grammar with nesting (JSON of any depth) needs a stack, and then the state alone does not
decide every token. xgrammar's trick is to split, for each grammar position, the vocabulary into
tokens decided by that position alone (precomputed once per grammar, "context-independent") and
the few whose fate depends on the stack below (checked at run time). A DFA is the case where
every token is context-independent: this lesson bounds JSON's depth to stay there.

The walk is vectorised: all tokens take their first byte through `table[state, byte]` at once,
then only the tokens still alive (and longer than the step) take the next byte, and so on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .dfa import DFA


def _bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character map of byte-level BPE (GPT-2, SmolLM2, Qwen): printable
    Latin-1 bytes stand for themselves, the others are shifted to code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


@dataclass
class TokenVocab:
    """The bytes of every token id (None: special or unusable), the model's vocab size, EOS ids."""
    token_bytes: list[bytes | None]
    vocab_size: int
    eos_ids: list[int]

    @classmethod
    def from_hf(cls, tokenizer, vocab_size: int | None = None, eos_ids: list[int] | None = None) -> "TokenVocab":
        """A Hugging Face byte-level BPE tokenizer; vocab_size: the model's (may exceed the tokenizer's)."""
        n = len(tokenizer)
        vocab_size = vocab_size or n
        if vocab_size < n:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n} tokens")
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        out: list[bytes | None] = []
        for i, piece in enumerate(pieces):
            if i in special or piece is None or not piece or any(c not in CHAR_TO_BYTE for c in piece):
                out.append(None)
            else:
                out.append(bytes(CHAR_TO_BYTE[c] for c in piece))
        if sum(b is not None for b in out) < n // 2:
            raise ValueError("the tokenizer does not look like a byte-level BPE (GPT-2/Qwen/SmolLM2 style)")
        eos = list(eos_ids) if eos_ids is not None else [tokenizer.eos_token_id]
        return cls(out + [None] * (vocab_size - n), vocab_size, [int(e) for e in eos if e is not None])

    def walk_arrays(self) -> tuple[torch.Tensor, np.ndarray, list[int]]:
        """What every TokenIndex of this vocabulary walks, built once: the usable token ids sorted
        longest first, their bytes as a zero-padded uint8 matrix [max length, tokens], and
        active[j] = how many of them (from the front) are longer than j."""
        if "_walk" not in self.__dict__:
            ids = [i for i, b in enumerate(self.token_bytes) if b]      # no empty or special tokens
            lens = np.array([len(self.token_bytes[i]) for i in ids], dtype=np.int64)
            order = np.argsort(-lens, kind="stable")
            matrix = np.zeros((len(ids), int(lens.max())), dtype=np.uint8)
            for row, k in enumerate(order):
                data = self.token_bytes[ids[k]]
                matrix[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            active = [int((lens > j).sum()) for j in range(matrix.shape[1])]
            # stored byte-column by byte-column ([L, N]): step j reads one contiguous row
            self.__dict__["_walk"] = (torch.tensor(np.array(ids, dtype=np.int64)[order]),
                                      np.ascontiguousarray(matrix.T), active)
        return self.__dict__["_walk"]


class TokenIndex:
    """A DFA joined to a vocabulary: allowed-token masks per state (cached) and token steps."""

    def __init__(self, dfa: DFA, vocab: TokenVocab):
        self.dfa, self.vocab = dfa, vocab
        self.ids, self.bytes, self.active = vocab.walk_arrays()
        self.masks: dict[int, torch.Tensor] = {}
        self.eos = torch.tensor(vocab.eos_ids, dtype=torch.long)

    def allowed(self, state: int) -> torch.Tensor:
        """bool [vocab_size]: the tokens that keep a full match possible (+ EOS where it accepts)."""
        mask = self.masks.get(state)
        if mask is None:
            mask = self.masks[state] = self._compute(state)
        return mask

    def _compute(self, state: int) -> torch.Tensor:
        table, dead = self.dfa.table, self.dfa.dead
        states = table[state][self.bytes[0]]                # every token's first byte, at once
        live = np.flatnonzero(states != dead)               # most tokens die here in a tight state
        for j in range(1, len(self.active)):
            live = live[live < self.active[j]]             # still alive and longer than j
            if live.size == 0:
                break
            states[live] = table[states[live], self.bytes[j, live]]
            live = live[states[live] != dead]
        mask = torch.zeros(self.vocab.vocab_size, dtype=torch.bool)
        mask[self.ids[torch.from_numpy(states != dead)]] = True
        if self.dfa.accepting[state]:
            mask[self.eos] = True
        return mask

    def advance(self, state: int, token: int) -> int:
        """The state after `token`; DEAD if it breaks the match (EOS leaves the state as it is)."""
        if token in self.vocab.eos_ids:
            return state if self.dfa.accepting[state] else self.dfa.dead
        data = self.vocab.token_bytes[token] if 0 <= token < self.vocab.vocab_size else None
        return self.dfa.dead if not data else self.dfa.walk(state, data)


@dataclass
class GuideState:
    """One request's place in its constraint: the DFA state, moved on by every generated token."""
    index: TokenIndex
    state: int = 0
    finished: bool = False
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = self.index.dfa.start

    def allowed(self) -> torch.Tensor:
        return self.index.allowed(self.state)

    def accept(self, token: int) -> None:
        """Record the sampled token; a token outside the mask is a bug upstream, not a user error."""
        if self.finished:
            raise RuntimeError("the guided request already ended with EOS")
        nxt = self.index.advance(self.state, token)
        if nxt == self.index.dfa.dead:
            raise RuntimeError(f"token {token} breaks the constraint {self.index.dfa.pattern!r} in state {self.state}")
        self.finished = token in self.index.vocab.eos_ids
        self.state = nxt
        self.tokens.append(token)

    @property
    def accepting(self) -> bool:
        return bool(self.index.dfa.accepting[self.state])
