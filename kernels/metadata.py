"""What attention needs to know about a flat batch: where each sequence's new tokens sit in
the batch, how long its context is, and where its KV lives in the paged cache.

A flat batch concatenates the new tokens of S sequences (T tokens in all). Sequence ``i``
brings ``query_start_loc[i+1] - query_start_loc[i]`` new tokens (a prompt chunk, one decode
token, or 1 + k tokens to verify) at the end of a context of ``seq_lens[i]`` tokens
(new tokens included). Its KV lives in the blocks listed in ``block_tables[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


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
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from host lists. ``block_tables[i]`` must cover ``seq_lens[i]`` tokens: a list of
        block ids per sequence, or an int32 ``[S, W]`` tensor already on ``device`` whose rows
        begin with them (the model runner's persistent rows; the caller checked their lengths)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        for q, s in zip(query_lens, seq_lens, strict=True):
            if q < 1 or q > s:
                raise ValueError(f"query length {q} must be in [1, seq_len={s}]")
        if isinstance(block_tables, torch.Tensor):
            if block_tables.shape[1] * block_size < max(seq_lens, default=0):
                raise ValueError(f"block tables of width {block_tables.shape[1]} cannot hold {max(seq_lens)} tokens")
            tables = block_tables
        else:
            for s, table in zip(seq_lens, block_tables, strict=True):
                if len(table) * block_size < s:
                    raise ValueError(f"block table of {len(table)} blocks cannot hold {s} tokens")
            max_blocks = max((len(t) for t in block_tables), default=1) or 1
            tables = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
            for i, t in enumerate(block_tables):
                if t:
                    tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            tables = tables.to(device)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        # slots of all new tokens at once: the block holding each position, and the offset in it
        q_t = torch.tensor(list(query_lens), dtype=torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(len(q_t)), q_t)  # [T] sequence of each token
        first = torch.tensor(list(seq_lens), dtype=torch.int64) - q_t  # [S] position of each first new token
        pos = first[seq_of] + torch.arange(int(q_t.sum())) - torch.tensor(qsl[:-1], dtype=torch.int64)[seq_of]  # [T]
        seq_of, pos = seq_of.to(device, non_blocking=True), pos.to(device, non_blocking=True)
        slots = tables[seq_of, pos // block_size].long() * block_size + pos % block_size  # [T]
        return cls(
            slot_mapping=slots,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=tables,
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
