"""Connection details shared by the async and sync clients."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

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
