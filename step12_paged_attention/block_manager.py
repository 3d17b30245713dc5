"""Hand out fixed-size KV blocks to sequences, like an OS hands out memory pages.

    physical pool (per layer):  [b0][b1][b2][b3][b4][b5][b6][b7] ...  each block = 16 token slots
    seq A block_table: [b3, b0, b6]      -> A's token 37 lives in b6, slot 37 % 16 = 5
    seq B block_table: [b1, b4]
    free: b2, b5, b7, ...
A sequence takes a new block only when its last one is full, so no memory is reserved for
tokens that may never be generated; a finished or preempted sequence returns its blocks at once.
The block table is stored in `seq.block_table` (a list of block ids), the slot of a token at position p
is block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from step09_continuous_batching.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def table(seq: Sequence) -> list[int]:
        if seq.block_table is None:
            seq.block_table = []
        return seq.block_table

    def room(self, seq: Sequence) -> int:
        """Tokens `seq` can still add: the unused tail of its last block plus every free block."""
        return len(self.table(seq)) * self.block_size - seq.num_computed_tokens + self.num_free_blocks * self.block_size

    def _take_free_block(self) -> int:
        block = self.blocks[self.free_block_ids.popleft()]
        assert block.ref_count == 0, f"free block {block.block_id} still referenced"
        block.ref_count = 1
        return block.block_id

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table until it has a slot for each of its first `num_tokens` tokens."""
        table = self.table(seq)
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(need):
            table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; a block nobody references goes back to the free list."""
        for block_id in reversed(seq.block_table or []):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = None
