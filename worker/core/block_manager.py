"""KV blocks: a ref-counted pool with a free list, and the per-request block tables built
on it. Pure Python, testable without a model."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from draftwise.worker.model.block_tables import BlockTable, truncate_table

__all__ = ["BlockManager", "BlockPool", "BlockPoolExhausted", "BlockTable"]


class BlockPoolExhausted(RuntimeError):
    """No free block (callers check ``num_free`` first; this is a bug guard)."""


class BlockPool:
    """``num_blocks`` blocks, each with a reference count; free blocks in a FIFO free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each)."""
        if n > len(self._free):
            raise BlockPoolExhausted(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks already in use (a second owner)."""
        for b in blocks:
            if self._ref[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block with none left returns to the free list."""
        for b in blocks:
            if self._ref[b] < 1:
                raise ValueError(f"block {b} released more often than taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def check(self, owners: Iterable[Iterable[int]]) -> None:
        """Assert the pool's invariants against the block tables that own blocks: every
        reference is accounted for by an owner, no block is both free and owned, the free
        list has no duplicates."""
        counts = [0] * self.num_blocks
        for table in owners:
            for b in table:
                counts[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free list twice")
        for b in range(self.num_blocks):
            if counts[b] != self._ref[b]:
                raise AssertionError(f"block {b}: ref count {self._ref[b]}, owned {counts[b]} times")
            if (b in free) != (self._ref[b] == 0):
                raise AssertionError(f"block {b}: ref count {self._ref[b]} but free={b in free}")


class BlockManager:
    """Grows and frees block tables (lists of block ids, :class:`BlockTable` in the engine) for
    token counts. Tables change only here, at their tail, so the model runner's device copy
    of each is updated with the changed entries alone."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, table: list[int], num_tokens: int) -> int:
        """Blocks ``table`` still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` in place to hold ``num_tokens`` tokens; False (table unchanged)
        when there are not enough free blocks."""
        need = self.extra_blocks(table, num_tokens)
        if need > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(need))
        return True

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks of ``table`` beyond those holding ``num_tokens`` tokens."""
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self.pool.release(table[keep:])
            truncate_table(table, keep)

    def free(self, table: list[int]) -> None:
        """Release every block of ``table`` and empty it."""
        self.pool.release(table)
        truncate_table(table, 0)
