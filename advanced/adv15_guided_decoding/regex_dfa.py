"""A small regex engine over BYTES: pattern -> syntax tree -> NFA (Thompson) -> DFA (subsets).

    "ab|c+"  --parse-->  alt(cat(a, b), rep(c, 1, inf))  --thompson-->  NFA with epsilon edges
             --subset construction-->  DFA: table[state, byte] -> state, accepting[state]

Why bytes and not characters: a token of a byte-level BPE vocabulary is a byte string, and
some tokens hold half of a UTF-8 character. Walking tokens byte by byte through the DFA makes
such tokens work without special cases. A non-ASCII literal becomes the chain of its UTF-8 bytes.

The subset supported (enough for JSON schemas and choice lists):
    literals, escapes \\xHH \\. \\\\ \\n \\t \\r \\d \\w \\s and escaped punctuation, classes [a-z0-9_]
    and [^...], ".", groups (...) and (?:...), alternation |, and the repeats * + ? {m} {m,} {m,n}.
Classes, "." and negated classes are ASCII-only ("." is any ASCII byte but newline), so every
string the DFA accepts is valid UTF-8. No anchors, lookarounds or backreferences: the whole
output must match the whole pattern, which is what guided decoding needs anyway.
"""
from __future__ import annotations

from dataclasses import dataclass


ASCII = frozenset(range(128))
DIGITS = frozenset(range(ord("0"), ord("9") + 1))
WORD = DIGITS | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {ord("_")}
SPACE = frozenset(b" \t\n\r\f\v")
ESCAPES = {"d": DIGITS, "w": WORD, "s": SPACE, "D": ASCII - DIGITS, "W": ASCII - WORD, "S": ASCII - SPACE,
           "n": frozenset(b"\n"), "t": frozenset(b"\t"), "r": frozenset(b"\r"), "f": frozenset(b"\f"),
           "v": frozenset(b"\v")}
MAX_REPEAT = 1000       # {m,n} copies the sub-pattern n times: a bound keeps the NFA finite and small


class RegexError(ValueError):
    """A pattern outside the supported subset, with the position of the problem."""


# ----------------------------------------------------------------------------- parsing
# A syntax tree of tuples: ("set", frozenset of bytes) | ("cat", [..]) | ("alt", [..]) | ("rep", node, m, n|None)

class _Parser:
    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def fail(self, what: str):
        raise RegexError(f"regex {self.p!r}: {what} at position {self.i}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.peek()
        if c is None:
            self.fail("unexpected end")
        self.i += 1
        return c

    def parse(self):
        node = self.alternation()
        if self.i != len(self.p):
            self.fail(f"unexpected {self.p[self.i]!r}")
        return node

    def alternation(self):
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("cat", items)

    def repeat(self, node):
        while (c := self.peek()) in ("*", "+", "?", "{"):
            self.i += 1
            if c == "{":
                m, n = self.bounds()
            else:
                m, n = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            node = ("rep", node, m, n)
        return node

    def bounds(self) -> tuple[int, int | None]:
        end = self.p.find("}", self.i)
        if end < 0:
            self.fail("'{' without '}'")
        body, self.i = self.p[self.i:end], end + 1
        lo, comma, hi = body.partition(",")
        if not lo.strip().isdigit() or (hi.strip() and not hi.strip().isdigit()):
            self.fail(f"bad repeat {{{body}}}")
        m = int(lo)
        n = (int(hi) if hi.strip() else None) if comma else m
        if (n is not None and n < m) or max(m, n or 0) > MAX_REPEAT:
            self.fail(f"repeat {{{body}}} must have m <= n <= {MAX_REPEAT}")
        return m, n

    def atom(self):
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            node = self.alternation()
            if self.peek() != ")":
                self.fail("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", ASCII - {ord("\n")})
        if c == "\\":
            return ("set", self.escape())
        if c in "*+?{":
            self.fail(f"nothing to repeat before {c!r}")
        data = c.encode()
        return ("set", frozenset(data)) if len(data) == 1 else ("cat", [("set", frozenset([b])) for b in data])

    def escape(self) -> frozenset[int]:
        c = self.take()
        if c in ESCAPES:
            return ESCAPES[c]
        if c == "x":                                        # \xHH, an ASCII byte by its code
            digits = self.p[self.i:self.i + 2]
            if len(digits) != 2 or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) > 127:
                self.fail("\\x needs two hex digits of an ASCII byte")
            self.i += 2
            return frozenset([int(digits, 16)])
        if c.isalnum():
            self.fail(f"unsupported escape \\{c}")
        return frozenset(c.encode()) if len(c.encode()) == 1 else self.fail("escaped non-ASCII character")

    def char_class(self) -> frozenset[int]:
        negate = self.peek() == "^"
        self.i += negate
        out: set[int] = set()
        first = True
        while (c := self.take()) != "]" or first:
            first = False
            if c == "\\":
                lo = self.escape()
                if len(lo) > 1:
                    out |= lo
                    continue
                (lo,) = lo
            else:
                if ord(c) > 127:
                    self.fail("non-ASCII character in a class")
                lo = ord(c)
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.take()
                hi = next(iter(self.escape())) if hi == "\\" else ord(hi)
                if hi < lo or hi > 127:
                    self.fail("bad class range")
                out |= set(range(lo, hi + 1))
            else:
                out.add(lo)
        return ASCII - out if negate else frozenset(out)


def parse(pattern: str):
    if not isinstance(pattern, str):
        raise RegexError(f"regex must be a string, got {type(pattern).__name__}")
    return _Parser(pattern).parse()


# ----------------------------------------------------------------------------- NFA

@dataclass
class NFA:
    eps: list[list[int]]                                   # eps[s]: states reachable for free
    edges: list[list[tuple[frozenset[int], int]]]          # edges[s]: (bytes, target)
    start: int
    accept: int

    def new(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1


def _build(nfa: NFA, node, start: int, end: int) -> None:
    """Thompson's construction: wire `node` between the states start and end."""
    kind = node[0]
    if kind == "set":
        nfa.edges[start].append((node[1], end))
    elif kind == "cat":
        cur = start
        for item in node[1]:
            nxt = nfa.new()
            _build(nfa, item, cur, nxt)
            cur = nxt
        nfa.eps[cur].append(end)
    elif kind == "alt":
        for branch in node[1]:
            _build(nfa, branch, start, end)
    else:                                                   # ("rep", sub, m, n): m copies, then the rest
        _, sub, m, n = node
        cur = start
        for _ in range(m):
            nxt = nfa.new()
            _build(nfa, sub, cur, nxt)
            cur = nxt
        if n is None:                                       # a loop: sub any number of times more
            loop = nfa.new()
            nfa.eps[cur].append(loop)
            back = nfa.new()
            _build(nfa, sub, loop, back)
            nfa.eps[back].append(loop)
            nfa.eps[loop].append(end)
        else:                                               # up to n - m optional copies
            for _ in range(n - m):
                nfa.eps[cur].append(end)
                nxt = nfa.new()
                _build(nfa, sub, cur, nxt)
                cur = nxt
            nfa.eps[cur].append(end)


def to_nfa(tree) -> NFA:
    nfa = NFA([], [], 0, 0)
    nfa.start, nfa.accept = nfa.new(), nfa.new()
    _build(nfa, tree, nfa.start, nfa.accept)
    return nfa
