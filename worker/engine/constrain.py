"""The step's constraint phase: between the forward pass and sampling / verification, the logits
rows of constrained requests are masked with their grammar (``draftwise.worker.sampling.grammar``):
a plain row with the mask of the output so far, a verify window row by row with the mask of the
output followed by the drafts before it (the grammar's refusals counted). One bitmask for the
step, filled on the host, applied in place in one call."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from draftwise.worker.core.containment import Failure, contain_each
from draftwise.worker.core.request import Request
from draftwise.worker.core.scheduler import ScheduledRequest
from draftwise.worker.sampling.grammar import Grammars

if TYPE_CHECKING:
    from draftwise.worker.speculative.decoder import SpecDecoder


def mask_logits(
    grammars: Grammars,
    logits: torch.Tensor,  # [rows, vocab], masked in place
    plain: list[tuple[Request, int]],  # (request, its logits row)
    verify: list[tuple[ScheduledRequest, int]],  # (request, its first logits row)
    spec: SpecDecoder | None,  # this step's drafts
) -> tuple[list[tuple[Request, int]], list[tuple[ScheduledRequest, int]], list[Failure]]:
    """Mask the rows of the constrained requests among ``plain`` and ``verify``; returns them
    without the requests whose matcher failed, and those as failures (their rows unmasked: the
    engine finishes them)."""
    if not grammars.states:
        return plain, verify, []
    work: list[tuple[Request, int, list[int]]] = [(r, row, []) for r, row in plain if r.request_id in grammars]
    for s, row in verify:
        if s.request.request_id in grammars:
            work.append((s.request, row, [] if spec is None else spec.draft_tokens(s.request)))
    if not work:
        return plain, verify, []
    t0 = time.perf_counter()
    mask = Grammars.new_mask(logits.shape[0], logits.shape[1])

    def fill(item: tuple[Request, int, list[int]]) -> list[int]:
        r, row, drafts = item
        grammars.fill(r.request_id, drafts, mask, row)
        return list(range(row, row + len(drafts) + 1))

    done, failed = contain_each(work, fill, lambda item: item[0])
    rows = [i for _, rs in done for i in rs]
    grammars.apply(logits, mask, rows)
    grammars.mask_seconds += time.perf_counter() - t0
    grammars.masked_rows += len(rows)
    grammars.masked_steps += 1
    if not failed:
        return plain, verify, []
    gone = {f.request.request_id for f in failed}
    return (
        [p for p in plain if p[0].request_id not in gone],
        [v for v in verify if v[0].request.request_id not in gone],
        failed,
    )


__all__ = ["mask_logits"]
