"""The unit of a forward pass: one sequence's share of a flat batch (its own module so that
the model runner and the graph runner both use it without importing each other)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SequenceChunk"]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a forward pass."""

    token_ids: Sequence[int]  # the new tokens
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: Sequence[int]  # KV blocks, covering start_pos + len(token_ids) tokens
    num_logits: int = 1  # logits wanted for the last n new tokens (0: none, e.g. mid-prompt chunk)
