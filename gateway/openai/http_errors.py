"""What the HTTP endpoint answers before a handler runs, in OpenAI's JSON error shape: request
bodies that are not JSON a server can hold (nesting too deep, integers too long), and aiohttp's
own protocol errors (headers over its 8 KiB limit, a malformed request line), which it would
otherwise answer in plain text."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from draftwise.gateway.openai.protocol import ApiError, error_body


def parse_json(data: bytes) -> object:
    """The JSON document in ``data``; ApiError(400) for anything else, including JSON too deeply
    nested for the parser (RecursionError) and integers longer than Python converts (ValueError)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError; so is a 5,000-digit int
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


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
