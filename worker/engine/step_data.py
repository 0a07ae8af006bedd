"""The data one engine step passes between its phases (docs/architecture.md, "The step"):
the new tokens of each request, the report of deltas and final outputs, and which logits rows
are whose."""

from __future__ import annotations

import time
from dataclasses import dataclass

from draftwise.worker.core.outputs import RequestDelta, RequestOutput, StepStats
from draftwise.worker.core.request import Request
from draftwise.worker.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from draftwise.worker.sampling.sampler import TokenLogprobs
from draftwise.worker.speculative.decoder import Verified


@dataclass(frozen=True)
class StepTokens:
    """New tokens for one request from this step's sampling or verification."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    verified: Verified | None = None  # the speculation round they come from (None: one sampled token)

    @property
    def num_accepted(self) -> int:
        """Drafts the round accepted (0 for a sampled token)."""
        return 0 if self.verified is None else self.verified.num_accepted


class StepReport:
    """The deltas and final outputs one step reports, in order."""

    def __init__(self, carried: StepReport | None = None) -> None:
        self.deltas: list[RequestDelta] = [] if carried is None else carried.deltas
        self.finished: list[RequestOutput] = [] if carried is None else carried.finished

    def add(self, delta: RequestDelta) -> None:
        self.deltas.append(delta)
        if delta.final is not None:
            self.finished.append(delta.final)


def logit_rows(
    scheduled: list[ScheduledRequest],
) -> tuple[list[tuple[Request, int]], list[tuple[ScheduledRequest, int]]]:
    """Which logits rows are whose: (request, row) of those that sample one token, and
    (request, first row) of those verifying drafts (read before progress moves)."""
    plain: list[tuple[Request, int]] = []
    verify: list[tuple[ScheduledRequest, int]] = []
    row = 0
    for s in scheduled:
        if s.num_draft_tokens:
            verify.append((s, row))
            row += 1 + s.num_draft_tokens
        elif s.samples:
            plain.append((s.request, row))
            row += 1
    return plain, verify


def step_stats(
    scheduled: list[ScheduledRequest],
    sched: SchedulerOutput,
    scheduler: Scheduler,
    num_free_blocks: int,
    t0: float,
    spec: tuple[int, int],  # drafts verified, accepted drafts that reached the output
) -> StepStats:
    """The step's stats, as it ends."""
    return StepStats(
        num_scheduled=len(scheduled),
        num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=len(sched.preempted),
        num_free_blocks=num_free_blocks,
        step_time=time.perf_counter() - t0,
        num_spec_proposed=spec[0],
        num_spec_accepted=spec[1],
    )
