"""Block tables kept on the device between steps.

A sequence's KV blocks are a :class:`BlockTable`: a list of block ids that changes only at its
tail (the block manager appends blocks as the sequence grows, and truncates or clears it when
rejected draft positions or a whole request give blocks back). Each table remembers, for every
reader holding a copy of it, how many of its leading entries are still the same as that copy.

:class:`BlockTableRows` is such a reader: a ``[rows, width]`` int32 tensor on the model's device
with one row per live table. Before a forward pass it copies into each table's row only the
entries that changed since the last pass (a decode step crossing a block boundary: one entry;
otherwise none), in one scatter for the whole batch, and hands attention the rows the batch
needs. The host work per step is therefore proportional to the number of sequences and new
blocks, never to how long the contexts are; rebuilding every table from Python lists each step
(what the engine did before) costs O(context) per sequence per step.

A row returns to the free list when its table is garbage collected. Plain lists (tests and
callers outside the engine) are accepted too: they get a scratch row, written in full, for the
one step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch

__all__ = ["MIN_WIDTH", "BlockTable", "BlockTableRows", "truncate_table"]

MIN_WIDTH = 16
"""The narrowest rows :meth:`BlockTableRows.gather` hands out."""


class BlockTable(list):  # list[int]; a subclass so that every list use of a table keeps working
    """A sequence's KV block ids, in order. Change it only by appending (``extend``) and by
    :func:`truncate_table`, so the copies readers keep stay exact."""

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        super().__init__(blocks)
        self.copies: dict[BlockTableRows, list[int]] = {}
        """Per reader: ``[row, synced, end]``: the reader's row, how many leading entries of it
        are still this table's, and how many leading entries of the row are not zero."""

    def __reduce__(self) -> tuple[type, tuple[list[int]]]:  # copies are per process: never carried
        return (BlockTable, (list(self),))


def truncate_table(table: list[int], n: int) -> None:
    """Keep the first ``n`` entries of ``table`` (the only way a table may shrink)."""
    del table[n:]
    if isinstance(table, BlockTable):
        for copy in table.copies.values():
            copy[1] = min(copy[1], n)


class BlockTableRows:
    """A persistent ``[rows, width]`` int32 copy of block tables on ``device`` (see the module
    docstring). Grows its rows and width on demand (doubling; rare, and never in steady state)."""

    def __init__(self, device: torch.device | str, rows: int = 64, width: int = 16) -> None:
        self.device = torch.device(device)
        self.table = torch.zeros(max(1, rows), max(1, width), dtype=torch.int32, device=self.device)
        self._free = list(range(self.table.shape[0] - 1, -1, -1))
        self.entries_written = 0
        """Block ids copied from host lists into rows so far, padding zeros not counted (tests
        read it per step)."""

    def _release(self, row: int) -> None:
        self._free.append(row)

    def _resize(self, rows: int, width: int) -> None:
        """Grow the table to ``rows`` x ``width`` (new entries 0), keeping what it holds."""
        old = self.table
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self.table[: old.shape[0], : old.shape[1]] = old

    def _take_row(self) -> int:
        if not self._free:
            n = self.table.shape[0]
            self._resize(2 * n, self.table.shape[1])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _fit_width(self, width: int) -> None:
        w = self.table.shape[1]
        if width > w:
            while w < width:
                w *= 2
            self._resize(self.table.shape[0], w)

    def gather(self, tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[len(tables), W]`` int32 on the device: row ``i`` is ``tables[i]`` padded with 0
        (attention masks what lies past a context; padding with one block keeps the keys a
        padded gather reads in cache, where stale ids would each fetch a block of their own).
        ``W`` is the longest table rounded up to a power of two, at least ``MIN_WIDTH``, so
        that the width, and what decode attention sizes from it, follows the step's longest
        context in a few buckets (and the row stride, which Triton specialises on, is always
        a multiple of 16: one compiled variant, not three)."""
        longest = max((len(t) for t in tables), default=1) or 1
        width = max(MIN_WIDTH, 1 << (longest - 1).bit_length())
        self._fit_width(width)
        rows: list[int] = []
        scratch: list[int] = []
        put_rows: list[int] = []
        put_cols: list[int] = []
        put_vals: list[int] = []
        for t in tables:
            if isinstance(t, BlockTable):
                copy = t.copies.get(self)
                if copy is None:
                    copy = t.copies[self] = [self._take_row(), 0, self.table.shape[1]]  # a reused row: stale
                    weakref.finalize(t, self._release, copy[0])
                row, start, end = copy
                copy[1] = copy[2] = len(t)
            else:
                row, start, end = self._take_row(), 0, self.table.shape[1]
                scratch.append(row)
            n = len(t) - start
            if n > 0:
                self.entries_written += n
                put_rows.extend([row] * n)
                put_cols.extend(range(start, len(t)))
                put_vals.extend(t[start:])
            if end > len(t):  # entries past the table read as block 0, as a fresh padded table would
                put_rows.extend([row] * (end - len(t)))
                put_cols.extend(range(len(t), end))
                put_vals.extend([0] * (end - len(t)))
            rows.append(row)
        if put_vals:
            index = torch.tensor([put_rows, put_cols], dtype=torch.int64).to(self.device, non_blocking=True)
            values = torch.tensor(put_vals, dtype=torch.int32).to(self.device, non_blocking=True)
            self.table.index_put_((index[0], index[1]), values)
        idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        out = self.table[:, :width].index_select(0, idx)
        self._free.extend(scratch)
        return out
