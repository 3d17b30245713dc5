"""Byte-level BPE from scratch: train, encode, decode, and load a real tokenizer.json.

The pipeline that turns text into ids, in the order `encode` runs it:

  1. split out added tokens (`<|im_start|>`, `<|endoftext|>`, ...): each becomes one id,
  2. normalize the text between them (Qwen3: Unicode NFC),
  3. pre-tokenize: a regex cuts the text into "words" (letters, digits, punctuation, spaces),
  4. map every UTF-8 byte of a word to a printable character (the GPT-2 byte alphabet),
  5. apply the learned merges, lowest rank first, until none applies,
  6. look every resulting piece up in the vocabulary.

`decode` walks back: id -> piece -> bytes -> UTF-8 text.
"""
from __future__ import annotations

import json
import operator
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import regex

# The pre-tokenizer regex of Qwen2/Qwen3 (also used by `train` by default). Compared with
# GPT-2's it keeps one leading non-letter on a word, splits digits one by one and keeps
# newlines apart from other whitespace.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to 256 printable characters.

    Printable Latin-1 bytes map to themselves; the other 68 (control characters, space,
    DEL, NBSP, soft hyphen) are moved to code points 256, 257, ... in byte order.
    That is why a space shows up as 'Ġ' (256 + 32) and a newline as 'Ċ' (256 + 10).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    mapping: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


@dataclass(repr=False)
class ByteLevelBPE:
    """A byte-level BPE tokenizer.

    vocab:          piece (in the byte alphabet) -> id
    merges:         ordered pairs; the index is the rank (lower merges first)
    pattern:        pre-tokenizer regex
    added_tokens:   literal strings cut out before BPE, each one id (content -> id)
    special:        the subset of added_tokens flagged special (controlled by allow_special,
                    dropped by decode(skip_special=True))
    normalize:      Unicode normal form applied before pre-tokenization ("NFC") or None
    """

    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    pattern: str = QWEN_PATTERN
    added_tokens: dict[str, int] = field(default_factory=dict)
    special: frozenset[str] = frozenset()
    normalize: str | None = None

    def __post_init__(self) -> None:
        self.ranks: dict[tuple[str, str], int] = {pair: i for i, pair in enumerate(self.merges)}
        self.id_to_piece: dict[int, str] = {i: p for p, i in self.vocab.items()}
        self.id_to_added: dict[int, str] = {i: t for t, i in self.added_tokens.items()}
        self.vocab_size = 1 + max([*self.id_to_piece, *self.id_to_added])
        self._word_re = regex.compile(self.pattern)
        self._added_re = self._alternation(self.added_tokens)
        self._ordinary_re = self._alternation(
            [t for t in self.added_tokens if t not in self.special])
        self._cache: dict[str, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return (f"ByteLevelBPE(pieces={len(self.vocab)}, merges={len(self.merges)}, "
                f"added_tokens={len(self.added_tokens)}, normalize={self.normalize!r})")

    @staticmethod
    def _alternation(tokens) -> regex.Pattern | None:
        # Longest first: regex alternation is leftmost-first, so this gives leftmost-longest.
        tokens = sorted(tokens, key=len, reverse=True)
        return regex.compile("|".join(regex.escape(t) for t in tokens)) if tokens else None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> "ByteLevelBPE":
        """Load a Hugging Face `tokenizer.json` whose model is byte-level BPE (GPT-2,
        Qwen2/3, Llama-3 style): vocab, merges, the Split pre-tokenizer regex, the
        normalizer and the added tokens."""
        path = Path(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: model type is {model.get('type')!r}, expected 'BPE'")
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                  for m in model["merges"]]
        added = data.get("added_tokens", [])
        if any(t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word")
               for t in added):
            raise ValueError(f"{path}: added tokens with normalized/lstrip/rstrip/single_word "
                             "are not supported by this lesson's encoder")
        return cls(
            vocab=dict(model["vocab"]),
            merges=merges,
            pattern=_split_pattern(data.get("pre_tokenizer"), path),
            added_tokens={t["content"]: t["id"] for t in added},
            special=frozenset(t["content"] for t in added if t.get("special")),
            normalize=_normal_form(data.get("normalizer"), path),
        )

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids. With allow_special=False the tokens flagged special (e.g.
        `<|im_start|>`) are encoded as plain text, which is what you want for untrusted
        user input; other added tokens (`<think>`) stay single ids, as in HF."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        splitter = self._added_re if allow_special else self._ordinary_re
        ids: list[int] = []
        start = 0
        if splitter is not None:
            for m in splitter.finditer(text):
                self._encode_ordinary(text[start:m.start()], ids)
                ids.append(self.added_tokens[m.group()])
                start = m.end()
        self._encode_ordinary(text[start:], ids)
        return ids

    def clear_cache(self) -> None:
        """Forget the per-word cache (encode fills it: each distinct word is merged once)."""
        self._cache.clear()

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        if not text:
            return
        if self.normalize:
            text = unicodedata.normalize(self.normalize, text)
        for word in self._word_re.findall(text):
            cached = self._cache.get(word)
            if cached is None:
                cached = self._cache[word] = self._bpe(word)
            out.extend(cached)

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Merge one pre-token: repeatedly merge the adjacent pair with the lowest rank."""
        parts = [BYTE_TO_CHAR[b] for b in word.encode("utf-8")]
        ranks = self.ranks
        while len(parts) > 1:
            best_rank, best_i = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        try:
            return tuple(self.vocab[p] for p in parts)
        except KeyError as e:
            raise ValueError(f"piece {e.args[0]!r} of {word!r} is not in the vocabulary") from None

    # ------------------------------------------------------------------ decoding
    def decode(self, ids, skip_special: bool = False) -> str:
        """Ids -> text. Bytes of consecutive pieces are joined before UTF-8 decoding, so a
        character split across tokens (common for Chinese and emoji) comes back whole;
        an invalid byte sequence (a cut in the middle of a character) becomes U+FFFD."""
        buf = bytearray()
        for pos, i in enumerate(ids):
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise TypeError(f"decode() expects ints, got {type(i).__name__} at position {pos}")
            i = operator.index(i)  # also accepts numpy / torch integer scalars
            if i in self.id_to_added:
                tok = self.id_to_added[i]
                if not (skip_special and tok in self.special):
                    buf += tok.encode("utf-8")
            elif i in self.id_to_piece:
                buf += bytes(CHAR_TO_BYTE[c] for c in self.id_to_piece[i])
            else:
                raise ValueError(f"token id {i} at position {pos} is out of range "
                                 f"(vocabulary has ids 0..{self.vocab_size - 1})")
        return buf.decode("utf-8", errors="replace")

    def piece(self, i: int) -> str:
        """The printable piece of one id, as stored in the vocabulary ('Ġthe', 'Ċ', ...)."""
        return self.id_to_added.get(i) or self.id_to_piece[i]

    # ------------------------------------------------------------------ training
    @classmethod
    def train(cls, text: str, vocab_size: int, pattern: str = QWEN_PATTERN,
              special_tokens: tuple[str, ...] = (), min_frequency: int = 2) -> "ByteLevelBPE":
        """Learn merges from `text` until the vocabulary (256 bytes + merges + special
        tokens) reaches `vocab_size`, or no pair occurs `min_frequency` times any more."""
        if not isinstance(text, str):
            raise TypeError(f"train() expects str, got {type(text).__name__}")
        base = 256 + len(special_tokens)
        if vocab_size < base:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the {base} ids the "
                             "256 bytes and the special tokens need")
        vocab = {BYTE_TO_CHAR[b]: b for b in range(256)}
        merges: list[tuple[str, str]] = []
        # Words never merge across a pre-token boundary, so count each distinct word once.
        words = Counter(regex.findall(pattern, text))
        seqs = {w: [BYTE_TO_CHAR[b] for b in w.encode("utf-8")] for w in words}
        while len(vocab) + len(special_tokens) < vocab_size:
            pairs: Counter[tuple[str, str]] = Counter()
            for w, n in words.items():
                s = seqs[w]
                for a, b in zip(s, s[1:]):
                    pairs[a, b] += n
            if not pairs:
                break
            # Most frequent pair; ties go to the lexicographically smallest (deterministic).
            pair, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
            if count < min_frequency:
                break
            merged = pair[0] + pair[1]
            merges.append(pair)
            vocab[merged] = len(vocab)
            for w, s in seqs.items():
                i = 0
                while i < len(s) - 1:
                    if s[i] == pair[0] and s[i + 1] == pair[1]:
                        s[i:i + 2] = [merged]
                    i += 1
        added = {t: len(vocab) + k for k, t in enumerate(special_tokens)}
        return cls(vocab=vocab, merges=merges, pattern=pattern, added_tokens=added,
                   special=frozenset(special_tokens))


def _split_pattern(pre: dict | None, path: Path) -> str:
    """Find the Split regex inside the pre_tokenizer (plain or in a Sequence)."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            if step.get("behavior") != "Isolated" or step.get("invert"):
                raise ValueError(f"{path}: only Split(behavior=Isolated) is supported")
            return step["pattern"]["Regex"]
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            raise ValueError(f"{path}: ByteLevel(use_regex=True) (the GPT-2 regex) is not "
                             "supported; this lesson expects a Split pre-tokenizer")
    raise ValueError(f"{path}: no Split pre-tokenizer regex found")


def _normal_form(norm: dict | None, path: Path) -> str | None:
    if norm is None:
        return None
    if norm.get("type") in ("NFC", "NFD", "NFKC", "NFKD"):
        return norm["type"]
    raise ValueError(f"{path}: normalizer {norm.get('type')!r} is not supported")
