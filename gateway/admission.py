"""Admission control: a gateway-wide cap on requests in flight, answered with
RESOURCE_EXHAUSTED and a retry hint when reached.

The hint travels the standard gRPC ways: trailing metadata ``grpc-retry-pushback-ms`` (what
gRPC's own retry policy reads), a ``google.rpc.RetryInfo`` detail inside a
``google.rpc.Status`` in ``grpc-status-details-bin`` (what Google-style clients read), and
``retry-after-ms`` (this server's original key, kept for existing clients). Everything a
rejection sends is built once per gateway: refusing a request is the cheapest path there is.
"""

from __future__ import annotations

from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata key of the retry hint on RESOURCE_EXHAUSTED (draftwise's own)."""
PUSHBACK_KEY = "grpc-retry-pushback-ms"
"""Trailing metadata key gRPC's retry policy reads (milliseconds, decimal)."""
STATUS_DETAILS_KEY = "grpc-status-details-bin"
"""Trailing metadata key of the serialized ``google.rpc.Status`` with its details."""


def retry_status(message: str, retry_after_ms: int) -> status_pb2.Status:
    """A RESOURCE_EXHAUSTED ``google.rpc.Status`` holding a ``RetryInfo`` of ``retry_after_ms``."""
    info = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=retry_after_ms // 1000, nanos=(retry_after_ms % 1000) * 1_000_000)
    )
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message)
    status.details.add().Pack(info)
    return status


class Admission:
    """Counts requests in flight (single event loop: no locking needed)."""

    def __init__(self, max_in_flight: int, retry_after_ms: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_ms = retry_after_ms
        self.in_flight = 0
        self._message = (
            f"the server is at capacity ({max_in_flight} requests in flight); "
            f"retry after {retry_after_ms} ms (trailing metadata {PUSHBACK_KEY})"
        )
        self._trailing = (
            (PUSHBACK_KEY, str(retry_after_ms)),
            (RETRY_AFTER_KEY, str(retry_after_ms)),
            (STATUS_DETAILS_KEY, retry_status(self._message, retry_after_ms).SerializeToString()),
        )

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
        return self._message

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The trailing metadata of a RESOURCE_EXHAUSTED call status (the same tuple every time)."""
        return self._trailing
