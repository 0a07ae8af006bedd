"""What attention needs to know about a flat batch: where each sequence's new tokens sit in
the batch, how long its context is, and where its KV lives in the paged cache.

A flat batch concatenates the new tokens of S sequences (T tokens in all). Sequence ``i``
brings ``query_start_loc[i+1] - query_start_loc[i]`` new tokens (a prompt chunk, one decode
token, or 1 + k tokens to verify) at the end of a context of ``seq_lens[i]`` tokens
(new tokens included). Its KV lives in the blocks listed in ``block_tables[i]``.

The host layout is built once per step by ``draftwise.kernels.flat_batch.FlatBatch``; this
metadata points at its device copy (:meth:`AttentionMetadata.for_batch`), or at a graph
runner's static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draftwise.kernels.flat_batch import DeviceBatch, FlatBatch


@dataclass
class AttentionMetadata:
    """Per-forward attention metadata, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: start of each sequence's tokens in the batch
    seq_lens: torch.Tensor  # [S] int32: context length after this step's tokens
    block_tables: torch.Tensor  # [S, max_blocks] int32: block ids, padded with 0
    block_size: int  # tokens per KV block
    query_lens_cpu: list[int]  # host copy of the per-sequence new-token counts
    seq_lens_cpu: list[int]  # host copy of seq_lens
    max_query_len: int  # longest new-token run
    max_seq_len: int  # longest context
    has_padding: bool = False  # some slot_mapping entries are -1 (graph padding): write nothing for them
    backend_state: dict[str, Any] = field(default_factory=dict)  # a backend's per-forward plan

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    @classmethod
    def for_batch(
        cls,
        batch: FlatBatch,
        device_batch: DeviceBatch,
        block_tables: torch.Tensor,  # [S, W] int32 on the device, W * block_size >= every context
        block_size: int,
    ) -> AttentionMetadata:
        """The metadata of ``batch`` uploaded as ``device_batch``, over ``block_tables`` (the
        model runner's persistent rows; ``batch`` checked that its tables cover its tokens)."""
        return cls(
            slot_mapping=device_batch.slot_mapping,
            query_start_loc=device_batch.query_start_loc,
            seq_lens=device_batch.seq_lens,
            block_tables=block_tables,
            block_size=block_size,
            query_lens_cpu=batch.query_lens,
            seq_lens_cpu=batch.seq_lens.tolist(),
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
        )

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From host lists (attention tests): sequence ``i`` brings ``query_lens[i]`` tokens at
        the end of a context of ``seq_lens[i]``, its KV in the blocks ``block_tables[i]``
        (covering it). Laid out by :meth:`FlatBatch.from_lengths`, tables padded with 0."""
        batch = FlatBatch.from_lengths(query_lens, seq_lens, block_tables, block_size)
        tables = torch.zeros(len(block_tables), max((len(t) for t in block_tables), default=1) or 1, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            if t:
                tables[i, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
        return cls.for_batch(batch, batch.upload(device), tables.to(device), block_size)
