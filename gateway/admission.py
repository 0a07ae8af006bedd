"""Admission control: a gateway-wide cap on requests in flight, answered with
RESOURCE_EXHAUSTED and a retry hint when reached."""

from __future__ import annotations

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata key of the retry hint on RESOURCE_EXHAUSTED."""


class Admission:
    """Counts requests in flight (single event loop: no locking needed)."""

    def __init__(self, max_in_flight: int, retry_after_ms: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_ms = retry_after_ms
        self.in_flight = 0

    def try_acquire(self) -> bool:
        """Take a slot; False (taking nothing) when all are in use."""
        if self.in_flight >= self.max_in_flight:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("Admission.release without a matching try_acquire")
        self.in_flight -= 1

    def rejection(self) -> str:
        """The RESOURCE_EXHAUSTED message, with the hint a client acts on."""
        return (
            f"the server is at capacity ({self.max_in_flight} requests in flight); "
            f"retry after {self.retry_after_ms} ms (trailing metadata {RETRY_AFTER_KEY})"
        )

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_KEY, str(self.retry_after_ms)),)
