"""Replay buffers of resumable requests.

Each request keeps the events the gateway relayed for it (worker deltas after failover
de-duplication, then its final event), serialized, so that a client whose connection dropped
can ``ResumeGeneration`` from any delta boundary. Bytes are counted per request and
gateway-wide (:class:`ReplayBudget`); a request whose next event would pass either cap drops
its buffer and is no longer resumable (``lost`` says why)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from draftwise.v1 import generate_service_pb2 as gspb

HANDLE_BYTES = 16
"""A resume handle is this many random bytes (128 bits), url-safe base64: unguessable."""


def new_handle() -> str:
    """A fresh resume handle."""
    return secrets.token_urlsafe(HANDLE_BYTES)


@dataclass
class ReplayBudget:
    """The gateway-wide byte cap of all replay buffers."""

    limit: int
    used: int = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class ResumeError(Exception):
    """A resume that cannot be served: ``code`` is "not_found" or "invalid_argument"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class ReplayBuffer:
    """One request's events: (first_token_index, token count, serialized GenerateResponse)."""

    budget: ReplayBudget
    limit: int
    entries: list[tuple[int, int, bytes]] = field(default_factory=list)
    final: bytes | None = None
    size: int = 0
    num_tokens: int = 0
    lost: str | None = None  # why this request is not resumable any more

    def add_delta(self, response: gspb.GenerateResponse) -> None:
        """Keep a delta event (its first_token_index must be ``num_tokens``)."""
        n = len(response.event.delta.token_ids)
        if self.lost is None:
            data = response.SerializeToString()
            if self._take(len(data)):
                self.entries.append((response.event.delta.first_token_index, n, data))
        self.num_tokens += n

    def set_final(self, response: gspb.GenerateResponse) -> None:
        if self.lost is None:
            data = response.SerializeToString()
            if self._take(len(data)):
                self.final = data

    def _take(self, n: int) -> bool:
        if self.size + n > self.limit:
            self.drop(f"its replay buffer passed the per-request cap of {self.limit} bytes (--resume-buffer-bytes)")
            return False
        if not self.budget.take(n):
            self.drop(
                f"the gateway's replay buffers passed their total cap of {self.budget.limit} bytes "
                "(--resume-buffer-total-bytes)"
            )
            return False
        self.size += n
        return True

    def drop(self, why: str) -> None:
        """Free the buffer; the request is no longer resumable, for reason ``why``."""
        if self.lost is None:
            self.lost = why
        self.budget.give(self.size)
        self.size = 0
        self.entries.clear()
        self.final = None

    def replay(self, next_token_index: int, request_id: str) -> list[gspb.GenerateResponse]:
        """The events from ``next_token_index`` on (the final one included once the request
        ended), carrying ``request_id``; ResumeError when that index is not a delta boundary or
        lies beyond what was produced."""
        if self.lost is not None:
            raise ResumeError("not_found", f"the request can no longer be resumed: {self.lost}")
        if next_token_index > self.num_tokens:
            raise ResumeError(
                "invalid_argument",
                f"next_token_index {next_token_index} is beyond the {self.num_tokens} tokens produced so far",
            )
        starts = {first for first, _n, _d in self.entries}
        if next_token_index != self.num_tokens and next_token_index not in starts:
            raise ResumeError(
                "invalid_argument",
                f"next_token_index {next_token_index} is not a delta boundary: give the first_token_index plus "
                "the token count of the last delta received (0 for everything)",
            )
        out = []
        for first, _n, data in self.entries:
            if first >= next_token_index:
                out.append(gspb.GenerateResponse.FromString(data))
        if self.final is not None:
            out.append(gspb.GenerateResponse.FromString(self.final))
        for r in out:
            r.event.request_id = request_id
        return out
