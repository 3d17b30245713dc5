"""NFA -> DFA by subset construction, with the byte alphabet compressed into classes.

    DFA state = the set of NFA states the bytes so far can have reached (after epsilon moves)
    table[state, byte] -> next state; DEAD (the last row) for "no match is possible any more"

Two things keep it small and fast in Python:
  - byte classes: bytes that every NFA edge treats alike (all of a-z in "[a-z]+", say) get one
    class, and the construction loops over the few classes, not the 256 bytes;
  - trimming: a state from which no accepting state can be reached is made DEAD, so the token
    index never lets a request walk into a corner it cannot finish from.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .regex_dfa import NFA, parse, to_nfa

MAX_STATES = 20000      # a guard: a pattern whose DFA explodes fails with a clear error, not a hang


@dataclass(frozen=True)
class DFA:
    table: np.ndarray         # int32 [num_states + 1, 256]; row DEAD = num_states maps to itself
    accepting: np.ndarray     # bool [num_states + 1]
    pattern: str
    start: int = 0

    @property
    def dead(self) -> int:
        return self.table.shape[0] - 1

    @property
    def num_states(self) -> int:
        return self.table.shape[0] - 1

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = int(self.table[state, b])
        return state

    def fullmatch(self, text: str | bytes) -> bool:
        data = text.encode() if isinstance(text, str) else text
        return bool(self.accepting[self.walk(self.start, data)])


def _closure(nfa: NFA, states) -> frozenset[int]:
    seen, todo = set(states), list(states)
    while todo:
        for t in nfa.eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)


def byte_classes(nfa: NFA) -> tuple[np.ndarray, list[int]]:
    """class_of[byte], and one representative byte per class."""
    sets = list({s for out in nfa.edges for s, _ in out})
    signature: dict[tuple, int] = {}
    class_of = np.empty(256, dtype=np.int32)
    reps: list[int] = []
    for b in range(256):
        sig = tuple(b in s for s in sets)
        if sig not in signature:
            signature[sig] = len(reps)
            reps.append(b)
        class_of[b] = signature[sig]
    return class_of, reps


def nfa_to_dfa(nfa: NFA, pattern: str = "") -> DFA:
    class_of, reps = byte_classes(nfa)
    start = _closure(nfa, [nfa.start])
    ids, order, moves = {start: 0}, [start], []
    while len(moves) < len(order):
        subset = order[len(moves)]
        row = []
        for b in reps:
            nxt = _closure(nfa, [t for s in subset for bs, t in nfa.edges[s] if b in bs])
            if not nxt:
                row.append(-1)
                continue
            if nxt not in ids:
                if len(order) >= MAX_STATES:
                    raise ValueError(f"regex {pattern!r}: the DFA has more than {MAX_STATES} states")
                ids[nxt] = len(order)
                order.append(nxt)
            row.append(ids[nxt])
        moves.append(row)
    accepting = [nfa.accept in s for s in order]
    live = _co_reachable(moves, accepting)
    n = len(order)
    table = np.full((n + 1, 256), n, dtype=np.int32)
    for s, row in enumerate(moves):
        if live[s]:
            cls = np.array([t if t >= 0 and live[t] else n for t in row], dtype=np.int32)
            table[s] = cls[class_of]
    return DFA(table, np.array(accepting + [False]), pattern)


def _co_reachable(moves: list[list[int]], accepting: list[bool]) -> list[bool]:
    """States from which some accepting state can be reached (the others behave as DEAD)."""
    live = list(accepting)
    changed = True
    while changed:
        changed = False
        for s, row in enumerate(moves):
            if not live[s] and any(t >= 0 and live[t] for t in row):
                live[s] = changed = True
    return live


@lru_cache(maxsize=256)
def compile_regex(pattern: str) -> DFA:
    """The DFA of `pattern` (cached: the same guided_regex in many requests compiles once)."""
    dfa = nfa_to_dfa(to_nfa(parse(pattern)), pattern)
    if not dfa.accepting[dfa.start] and (dfa.table[dfa.start] == dfa.dead).all():
        raise ValueError(f"regex {pattern!r} matches nothing")
    return dfa
