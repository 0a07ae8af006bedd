"""OpenAI's error shape: :class:`ApiError` (an HTTP status, a message, the offending field) and
the JSON error object it becomes. The OpenAI endpoint's modules raise it; the server answers it."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``message``, ``param`` (the offending field)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
    }


def show(v: object) -> str:
    """A short repr of an offending value (a huge integer is not converted to text)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
