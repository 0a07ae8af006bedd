"""``--stats`` of ``draftwise chat`` and ``draftwise generate``: after each reply, one line on
stderr with its token count and its speculative decoding counters,
``[N tokens, speculation: A of P drafts accepted, L tokens per verify pass]`` or
``[N tokens, no speculation]``.

The counters are the request's own, as the server reports them: the finished event's usage
(``completion_tokens``, ``speculative_proposed_tokens``, ``speculative_accepted_tokens``) and
the last ``SpeculationStats`` of its deltas (``verify_steps``: target passes that verified at
least one draft token; tokens per verify pass is its ``mean_accepted_length``,
``1 + accepted / verify_steps``). stdout keeps the text alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol, TextIO

__all__ = ["STATS_HELP", "SpecCounts", "print_stats", "spec_counts", "stats_line"]

STATS_HELP = (
    "after each reply, print its token count and speculative decoding counters to stderr: "
    "[N tokens, speculation: A of P drafts accepted, L tokens per verify pass]"
)


@dataclass(frozen=True)
class SpecCounts:
    """A speculating request's counters (cumulative)."""

    proposed: int  # draft tokens proposed
    accepted: int  # of which the target accepted
    verify_steps: int  # target passes that verified at least one draft token


class _HasVerifySteps(Protocol):
    @property
    def verify_steps(self) -> int: ...


def spec_counts(proposed: int, accepted: int, last: _HasVerifySteps | None) -> SpecCounts | None:
    """The counters of a finished request: ``proposed`` and ``accepted`` from its usage (the
    totals), ``last`` the last speculation counters its deltas carried (the wire's
    ``SpeculationStats`` or the Python client's; None when no delta carried any). None when the
    request did not speculate."""
    if last is None and not proposed:
        return None
    return SpecCounts(proposed, accepted, 0 if last is None else int(last.verify_steps))


def stats_line(tokens: int, spec: SpecCounts | None) -> str:
    """The line: ``spec`` None when the request did not speculate."""
    head = f"[{tokens} token{'s' * (tokens != 1)}"
    if spec is None:
        return f"{head}, no speculation]"
    out = f"{head}, speculation: {spec.accepted} of {spec.proposed} drafts accepted"
    if spec.verify_steps:
        out += f", {1 + spec.accepted / spec.verify_steps:.1f} tokens per verify pass"
    return out + "]"


def print_stats(tokens: int, spec: SpecCounts | None, err: TextIO | None = None) -> None:
    """Write :func:`stats_line` to stderr (or ``err``), flushed."""
    err = sys.stderr if err is None else err
    print(stats_line(tokens, spec), file=err, flush=True)
