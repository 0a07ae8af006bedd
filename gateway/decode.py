"""Malformed bytes on the services the gateway hosts but did not write (gRPC health checking,
server reflection): answered INVALID_ARGUMENT, logged and counted, like on GenerateService.

gRPC's own handling of a request that fails to deserialize is UNKNOWN ("Unexpected
DecodeError"). This interceptor takes the deserializer out of such handlers and parses inside
the call instead, where a failure can end the call with a proper status. GenerateService's
handlers already take raw bytes (see ``service.py``) and are left alone.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from draftwise.gateway.errors import clip
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.wire import handler_like

log = structlog.get_logger("draftwise.gateway.decode")

Deserializer = Callable[[bytes], Any]


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """Makes a request that does not parse an INVALID_ARGUMENT of its call."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._invalid = metrics.requests.labels("invalid_argument")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._wrap(handler, handler_call_details.method or "")

    async def _parse(
        self, deserialize: Deserializer, data: bytes, context: grpc.aio.ServicerContext, method: str
    ) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or whatever a generated FromString raises on bad bytes
            self._invalid.inc()
            log.warning("bad message", method=method, bytes=len(data), error=clip(str(e), 200))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed message: {len(data)} bytes that do not parse ({clip(str(e))})",
            )

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserialize: Any = handler.request_deserializer
        parse = self._parse

        streaming = handler.request_streaming
        # Any: grpc's stubs type handlers' behaviours as sync functions; on grpc.aio they are coroutines
        inner: Any = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary

        async def requests(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for data in raw:
                yield await parse(deserialize, data, context, method)

        async def request_of(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            if streaming:
                return requests(raw, context)
            return await parse(deserialize, raw, context, method)

        async def streamed(raw: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in inner(await request_of(raw, context), context):
                yield response

        async def answered(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner(await request_of(raw, context), context)

        behaviour = streamed if inspect.isasyncgenfunction(inner) else answered
        return handler_like(handler, behaviour)  # no deserializer: the bytes are parsed above
