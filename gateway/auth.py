"""API keys: a server interceptor that answers UNAUTHENTICATED unless the call carries
``authorization: Bearer <key>`` with a configured key. Health checking and reflection stay
open (load balancers and ``buf curl --list-methods`` need no key)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from draftwise.wire import handler_like

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods served without a key."""


def load_api_keys(file: str | Path | None = None, env_var: str | None = None) -> frozenset[str]:
    """Keys from ``file`` (one per line; blank lines and ``#`` comments skipped) and from the
    environment variable ``env_var`` (separated by commas or whitespace), together."""
    keys: set[str] = set()
    if file is not None:
        try:
            text = Path(file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the API key file {file}: {e.strerror or e}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
        if not keys:
            raise ValueError(f"the API key file {file} holds no key")
    if env_var:
        keys.update(k for k in os.environ.get(env_var, "").replace(",", " ").split() if k)
    return frozenset(keys)


DRAIN_BEFORE_DENY_S = 1.0
"""How long a refused client-streaming call is read (and discarded) before it is ended."""


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED.

    On client-streaming calls the client's messages are first read and dropped until it
    half-closes (for at most DRAIN_BEFORE_DENY_S): an asyncio client whose write races
    with the server's status otherwise reports INTERNAL instead of UNAUTHENTICATED
    (grpc/grpc#36066)."""

    async def drain(requests: AsyncIterator[Any]) -> None:
        async for _ in requests:
            pass

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        if handler.request_streaming:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(drain(request), DRAIN_BEFORE_DENY_S)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return handler_like(handler, abort, handler.request_deserializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """TGI-style bearer-token check on every call but health and reflection."""

    def __init__(self, keys: frozenset[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = tuple(k.encode() for k in keys)

    def check(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """None when ``metadata`` carries a valid key, else what is wrong, in words."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return "missing API key: send the metadata 'authorization: Bearer <key>'"
        token = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, key = token.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "malformed authorization metadata: expected 'Bearer <key>'"
        given = key.strip().encode()
        ok = False
        for k in self._keys:  # compare against every key: timing says nothing about which matched
            ok |= hmac.compare_digest(given, k)
        return None if ok else "invalid API key"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        problem = self.check(handler_call_details.invocation_metadata)
        return handler if problem is None else _deny(handler, problem)
