"""A penalised request's token counts, kept on the device between steps.

Repetition, frequency and presence penalties need, for every row, how often each token id
occurs in the output and which ids the prompt holds. Rebuilt from the token lists every
step, that is host work proportional to the whole context, per request, per step (and per
draft position under speculation). :class:`TokenCounts` keeps both as ``[vocab]`` tensors
on the logits' device and adds only the tokens appended since the last step (one
``index_add_``), so a step's host work no longer grows with context. A request gets one when
it asks for a penalty (``Request.sampling_row``); it goes away with the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["TokenCounts", "add_token_ids"]


def add_token_ids(counts: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """Add one to ``counts`` ([vocab], in place) at each of ``ids``; returns ``counts``.
    Raises ValueError for an id outside the vocabulary."""
    vocab = counts.shape[0]
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab}) for a vocabulary of {vocab}")
    idx = torch.tensor(list(ids), dtype=torch.int64).to(counts.device, non_blocking=True)
    return counts.index_add_(0, idx, torch.ones(idx.shape[0], dtype=counts.dtype, device=counts.device))


class TokenCounts:
    """Output token counts and prompt ids of one request, on one device, grown incrementally."""

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None  # [vocab] int32: occurrences in the output counted so far
        self.prompt_seen: torch.Tensor | None = None  # [vocab] bool: ids the prompt holds
        self.counted = 0  # output tokens already in ``output``
        self.tokens_added = 0
        """Tokens added from host lists so far, the prompt's included (tests read it per step)."""

    def _add(self, counts: torch.Tensor, ids: Sequence[int]) -> None:
        add_token_ids(counts, ids)
        self.tokens_added += len(ids)

    def sync(
        self, prompt: Sequence[int], output: Sequence[int], vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output counts [vocab] int32, prompt seen [vocab] bool)`` for ``output`` as it is
        now: only the tokens appended since the last call are added (all of them again if the
        output got shorter, or the vocabulary or device changed)."""
        out = self.output
        if out is None or out.shape[0] != vocab or out.device != device or len(output) < self.counted:
            out = self.output = torch.zeros(vocab, dtype=torch.int32, device=device)
            self.counted = 0
            seen = torch.zeros(vocab, dtype=torch.int32, device=device)
            self._add(seen, prompt)
            self.prompt_seen = seen > 0
        new = output[self.counted :]
        if new:
            self._add(out, new)
            self.counted = len(output)
        assert self.prompt_seen is not None
        return out, self.prompt_seen
