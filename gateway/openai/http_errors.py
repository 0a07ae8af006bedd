"""Errors and plumbing of the HTTP endpoint: what it answers before a handler runs, in OpenAI's JSON error shape: request
bodies that are not JSON a server can hold (nesting too deep, integers too long), and aiohttp's
own protocol errors (headers over its 8 KiB limit, a malformed request line), which it would
otherwise answer in plain text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from draftwise.gateway.openai.protocol import ApiError, error_body
from draftwise.gateway.streams import Outbox

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""HTTP status of each gRPC status code a request can end with (others: 500)."""
_CODES = {c.value[0]: c for c in grpc.StatusCode}


async def merged(outboxes: list[Outbox]) -> AsyncIterator[tuple[int, Any]]:
    """The responses of several requests' outboxes as they come, each with its request's index,
    until every one has given its final response (finished, error, or None)."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, outbox: Outbox) -> None:
        while True:
            resp = await outbox.get()
            await queue.put((i, resp))
            if resp is None or resp.event.WhichOneof("kind") != "delta":
                return

    tasks = [asyncio.create_task(pump(i, ob)) for i, ob in enumerate(outboxes)]
    try:
        left = len(outboxes)
        while left:
            i, resp = await queue.get()
            if resp is None or resp.event.WhichOneof("kind") != "delta":
                left -= 1
            yield i, resp
    finally:
        for task in tasks:
            task.cancel()


def parse_json(data: bytes) -> object:
    """The JSON document in ``data``; ApiError(400) for anything else, including JSON too deeply
    nested for the parser (RecursionError) and integers longer than Python converts (ValueError)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError; so is a 5,000-digit int
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


def error_code(status: int) -> str | None:
    return {404: "model_not_found", 429: "rate_limit_exceeded"}.get(status)


def raise_if_error(resp: Any) -> None:
    """ApiError for a final error event (or a relay that ended without one)."""
    if resp is None:
        raise ApiError(500, "the request ended without a final event")
    if resp.event.WhichOneof("kind") == "error":
        err = resp.event.error
        code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
        status = HTTP_STATUS.get(code, 500)
        raise ApiError(status, err.message, code=error_code(status))


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, with its error responses in OpenAI's JSON shape."""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response was sent already
        text = str(getattr(exc, "message", None) or message or exc or "malformed HTTP request")
        if isinstance(exc, LineTooLong):
            text = f"a header (or the request line) is too long: {text[:120]} Send shorter headers."
        elif status < 500:
            text = f"malformed HTTP request: {text}"
        body: dict[str, Any] = error_body(status, text[:300])
        resp = web.Response(status=status, text=json.dumps(body), content_type="application/json")
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


def json_errors(runner: web.AppRunner) -> None:
    """Make the connections of ``runner`` (after ``setup``) answer protocol errors in JSON."""
    server = runner.server
    assert server is not None, "call after runner.setup()"
    server.__class__ = _JsonErrorServer
