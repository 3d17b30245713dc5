"""Which request sits in which row: the bookkeeping that turns each step into a BatchUpdate.

    last step's rows    [A, B, C, D]          this step's logits rows: [D, E, A]
    1. removed          B, C leave            rows 1, 2 empty
    2. added            E takes the lowest    E -> row 1 (listed in added only, not removed)
                        empty row
    3. condense         the highest row fills  D: row 3 -> row 2 (UNIDIRECTIONAL)
                        the lowest hole        rows [A, E, D]
    4. order            swaps put the rows in  swap 0 <-> 2: [D, E, A] (SWAP)
                        the logits' order

Rows stay where they are as long as possible (a processor keeps its state where it is), holes
are filled by the newest request or by the last row (vLLM's "condense"), and the batch is dense
and in the step's order at the end, so row i of the logits is row i of every processor's state.

In this tutorial's engines the logits hold one row per request that gets a token this step
(lesson 09's rule): a request in the middle of a chunked prompt, or preempted, has no row, so
it leaves the batch and joins again later. That is safe because a processor's state is made
from the request's params, prompt and (live) output ids, which say everything it needs.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from .processors import AddedRequest, BatchUpdate, MoveDirection


class OutputIds(Seq[int]):
    """A live view of a request's generated ids: token_ids[num_prompt:] without copying.

    Lesson 09's Sequence keeps prompt and output in one list, and its output_token_ids is a
    new slice each call; processors want a list that grows by itself, as vLLM hands them."""

    def __init__(self, token_ids: list[int], num_prompt: int):
        self._ids, self._start = token_ids, num_prompt

    def __len__(self) -> int:
        return len(self._ids) - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._ids[self._start:][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._ids[self._start + (i % n)]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


class PersistentBatch:
    """rows[i] is the request in row i. update(requests) -> the BatchUpdate to reach that order.

    A request is any object with params, prompt_token_ids and token_ids (prompt + output),
    such as lesson 09's Sequence; it is known by identity."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def update(self, requests: list[Any]) -> BatchUpdate | None:
        """None when nothing changed (the same requests in the same rows)."""
        if len({id(r) for r in requests}) != len(requests):
            raise ValueError("a request appears twice in one step")
        if [id(r) for r in self.rows] == [id(r) for r in requests]:
            return None
        wanted = {id(r) for r in requests}
        rows: list[Any] = [r if r is not None and id(r) in wanted else None for r in self.rows]
        freed = [i for i, (old, new) in enumerate(zip(self.rows, rows)) if old is not None and new is None]
        update = BatchUpdate(batch_size=len(requests))
        # 1-2. leave, then join: a new request takes the lowest empty row, else a new one
        present = {id(r) for r in rows if r is not None}
        for req in requests:
            if id(req) in present:
                continue
            row = rows.index(None) if None in rows else len(rows)
            if row == len(rows):
                rows.append(None)
            rows[row] = req
            update.added.append(AddedRequest(row, req.params, list(req.prompt_token_ids),
                                             OutputIds(req.token_ids, len(req.prompt_token_ids))))
        taken = {a.row for a in update.added}
        update.removed = [i for i in freed if i not in taken]
        # 3. condense: the last occupied row moves into the first hole until none is left
        while rows and rows[-1] is None:
            rows.pop()
        while None in rows:
            hole = rows.index(None)
            last = len(rows) - 1
            rows[hole] = rows.pop()
            update.moved.append((last, hole, MoveDirection.UNIDIRECTIONAL))
            while rows and rows[-1] is None:
                rows.pop()
        # 4. the step's order, by swaps
        where = {id(r): i for i, r in enumerate(rows)}
        for i, req in enumerate(requests):
            j = where[id(req)]
            if j != i:
                rows[i], rows[j] = rows[j], rows[i]
                where[id(rows[i])], where[id(rows[j])] = i, j
                update.moved.append((i, j, MoveDirection.SWAP))
        self.rows = rows
        return update
