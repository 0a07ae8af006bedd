"""How a request ends in error at the gateway: :class:`RequestError` (a status code and a
message a person can act on), the final error event that carries one on a stream
(:func:`error_response`), and :func:`clip`, which keeps client input quoted in a message
bounded."""

from __future__ import annotations

import grpc

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb

CLIP_CHARS = 64
"""Client-supplied strings quoted in an error message are cut to this many characters."""
MAX_DETAILS_CHARS = 1024
"""A worker's error message is passed on cut to this length (it may quote the client's input)."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, "..." marking the cut: client input quoted in an
    error message must never make it unbounded (gRPC sends the message as metadata, which
    has its own, much smaller, limit)."""
    return text if len(text) <= limit else f"{text[:limit]}..."


class RequestError(Exception):
    """A request ends with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_response(
    request_id: str, code: grpc.StatusCode, message: str, retry_after_ms: int = 0
) -> gspb.GenerateResponse:
    """The final error event of ``request_id`` (on a multiplexed stream, a request's error is
    its own last message; the stream stays up)."""
    error = pb.RequestError(code=code.value[0], message=message, retry_after_ms=retry_after_ms)
    return gspb.GenerateResponse(event=pb.GenerationEvent(request_id=request_id, error=error))
