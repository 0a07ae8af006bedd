"""The flat batch: one forward pass's new tokens, laid out once on the host.

A step concatenates the new tokens of ``S`` sequences (``N`` tokens in all): sequence ``i``
brings ``n_i`` tokens (a prompt chunk, one decode token, or 1 + k tokens to verify) at
positions ``start_i .. start_i + n_i - 1``, and asks for the logits of its last
``num_logits_i`` tokens. :meth:`FlatBatch.build` validates the chunks once and lays out, as
host arrays, everything the model and attention read: token ids, positions, the cache slot of
each token, where each sequence's tokens start, each sequence's context length, and the rows
whose logits were asked for. The eager path uploads it as it is (:meth:`FlatBatch.upload`: one
copy per dtype); the graph path pads it into its static buffers
(``draftwise.worker.model.graph_runner.pad_batch``).

Host work is proportional to the step's tokens and sequences, never to their contexts: of each
block table only the entries of the blocks the new tokens land in are read (a decode step reads
one). The block tables themselves stay the chunks' own (``block_tables``) for the device rows
that attention reads (``draftwise.worker.model.block_tables``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = ["Chunk", "DeviceBatch", "FlatBatch"]


class Chunk(Protocol):
    """One sequence's share of a flat batch (``draftwise.worker.model.chunk.SequenceChunk``)."""

    @property
    def token_ids(self) -> Sequence[int]: ...  # the new tokens
    @property
    def start_pos(self) -> int: ...  # tokens of this sequence already in the KV cache
    @property
    def block_table(self) -> Sequence[int]: ...  # KV blocks covering start_pos + len(token_ids)
    @property
    def num_logits(self) -> int: ...  # logits wanted for the last num_logits new tokens


@dataclass(frozen=True)
class _Lengths:
    """A chunk given by its lengths only (kernel tests): token ids 0, no logits."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 0


@dataclass(frozen=True)
class DeviceBatch:
    """A :class:`FlatBatch`'s arrays on the device (views of one upload per dtype)."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    logit_rows: torch.Tensor  # [L] int64
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32


@dataclass(frozen=True)
class FlatBatch:
    """A validated step laid out flat on the host: sequence after sequence, in chunk order."""

    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int64: block * block_size + offset of each token's cache slot
    query_start_loc: np.ndarray  # [S + 1] int32: start of each sequence's tokens
    seq_lens: np.ndarray  # [S] int32: context length after this step's tokens
    logit_rows: np.ndarray  # [L] int64: rows whose logits were asked for, in order
    block_tables: Sequence[Sequence[int]]  # [S] the chunks' own tables (not copied)
    max_query_len: int  # most tokens of one sequence (0 when empty)
    max_seq_len: int  # longest context (0 when empty)

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> list[int]:
        """Tokens of each sequence (host ints)."""
        qsl = self.query_start_loc
        return (qsl[1:] - qsl[:-1]).tolist()

    @classmethod
    def build(cls, chunks: Sequence[Chunk], block_size: int, max_positions: int | None = None) -> FlatBatch:
        """Validate ``chunks`` and lay them out. Raises ValueError for a chunk with no tokens,
        ``num_logits`` outside ``[0, tokens]``, a negative start, a position at or past
        ``max_positions``, or a block table too short for its tokens. No chunks: an empty batch."""
        s = len(chunks)
        ns = np.empty(s, dtype=np.int64)  # [S] tokens per sequence
        starts = np.empty(s, dtype=np.int64)  # [S] first new position
        wanted = np.empty(s, dtype=np.int64)  # [S] logits asked for
        first_blocks = np.empty(s, dtype=np.int64)  # [S] block of the first new token
        ids: list[int] = []
        longest = max_len = 0
        blocks: list[int] = []  # the blocks the new tokens land in, sequence after sequence
        for i, c in enumerate(chunks):
            n, start, k, table = len(c.token_ids), c.start_pos, c.num_logits, c.block_table
            if n == 0:
                raise ValueError(f"sequence {i}: a sequence chunk must bring at least one token")
            if not 0 <= k <= n:
                raise ValueError(f"sequence {i}: num_logits {k} must be in [0, {n}]")
            if start < 0:
                raise ValueError(f"sequence {i}: start_pos {start} is negative")
            if max_positions is not None and start + n > max_positions:
                raise ValueError(f"position {start + n - 1} is beyond the model's context of {max_positions} tokens")
            first, last = start // block_size, (start + n - 1) // block_size
            if len(table) <= last:
                raise ValueError(f"sequence {i}: block table of {len(table)} blocks cannot hold {start + n} tokens")
            ns[i], starts[i], wanted[i], first_blocks[i] = n, start, k, first
            longest, max_len = max(longest, n), max(max_len, start + n)
            ids.extend(c.token_ids)
            blocks.extend(table[first : last + 1])  # O(new tokens), not O(context)
        # (ndarray methods rather than numpy's Python-level functions: fewer calls per step)
        ends = ns.cumsum()  # [S] one past each sequence's last row
        seq_of = np.arange(s).repeat(ns)  # [N] sequence of each token
        j = np.arange(len(ids)) - (ends - ns)[seq_of]  # [N] index within its sequence
        pos = starts[seq_of] + j  # [N]
        lens = starts + ns  # [S]
        # block of each token: its sequence's first new block in ``blocks``, plus how far it is past it
        span = (lens - 1) // block_size - first_blocks + 1  # [S] blocks each sequence's tokens touch
        block_at = (span.cumsum() - span)[seq_of] + pos // block_size - first_blocks[seq_of]  # [N]
        slots = np.asarray(blocks, dtype=np.int64)[block_at] * block_size + pos % block_size  # [N]
        qsl = np.zeros(s + 1, dtype=np.int32)
        qsl[1:] = ends
        return cls(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=pos,
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=lens.astype(np.int32),
            logit_rows=(j >= (ns - wanted)[seq_of]).nonzero()[0],  # the last num_logits of each sequence
            block_tables=[c.block_table for c in chunks],
            max_query_len=longest,
            max_seq_len=max_len,
        )

    @classmethod
    def from_lengths(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> FlatBatch:
        """A batch given by lengths (attention tests): sequence ``i`` brings ``query_lens[i]``
        tokens (ids 0, no logits) at the end of a context of ``seq_lens[i]``."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        for q, s in zip(query_lens, seq_lens, strict=True):
            if q < 1 or q > s:
                raise ValueError(f"query length {q} must be in [1, seq_len={s}]")
        runs = [_Lengths([0] * q, s - q, t) for q, s, t in zip(query_lens, seq_lens, block_tables, strict=True)]
        return cls.build(runs, block_size)

    def upload(self, device: torch.device | str) -> DeviceBatch:
        """The arrays on ``device``: one host-to-device copy per dtype."""
        n, rows = self.num_tokens, self.logit_rows.shape[0]
        i64 = np.concatenate((self.input_ids, self.positions, self.slot_mapping, self.logit_rows))
        i32 = np.concatenate((self.query_start_loc, self.seq_lens))
        d64 = torch.from_numpy(i64).to(device, non_blocking=True)  # [3N + L]
        d32 = torch.from_numpy(i32).to(device, non_blocking=True)  # [2S + 1]
        s1 = self.query_start_loc.shape[0]
        return DeviceBatch(
            input_ids=d64[:n],
            positions=d64[n : 2 * n],
            slot_mapping=d64[2 * n : 3 * n],
            logit_rows=d64[3 * n : 3 * n + rows],
            query_start_loc=d32[:s1],
            seq_lens=d32[s1:],
        )
