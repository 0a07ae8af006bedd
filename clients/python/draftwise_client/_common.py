"""What the async and sync clients share: connection details, and what a session's request
stream shows of its core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from draftwise_client._core import RequestCore
    from draftwise_client._resume import Progress

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = 1  # grpc.health.v1.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class Connection:
    """Where and how to reach a draftwise server."""

    target: str
    api_key: str | None = None
    tls: bool = False
    root_certificates: bytes | None = None  # PEM; None: the system's roots (with tls)
    options: tuple[tuple[str, int | str], ...] = ()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    @property
    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.root_certificates):
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


def empty(_: object) -> bytes:
    """Serialized grpc.health.v1.HealthCheckRequest with service "" (the whole server)."""
    return b""


def health_status(data: bytes) -> int:
    """The status field (1) of a serialized HealthCheckResponse; 0 (UNKNOWN) when absent."""
    i, status = 0, 0
    while i < len(data):
        tag = data[i]
        i += 1
        value, shift = 0, 0
        while True:  # every field of this message is a varint
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if tag == 0x08:
            status = value
    return status


class RequestView:
    """What a session's request stream (async or sync) shows of its state machine."""

    core: RequestCore
    """Its state machine (attempts, resume handle, tokens received)."""

    @property
    def progress(self) -> Progress:
        """Its resume handle and the tokens received."""
        return self.core.progress

    @property
    def attempts(self) -> int:
        """Times the request was sent (retries after a refusal, and sends again on a new stream
        when the old one broke before its first delta, included)."""
        return self.core.attempts

    @property
    def resumes(self) -> int:
        """Times the request was resumed on a new stream after its connection dropped."""
        return self.core.resumes
