"""``draftwise.v1.GenerateService``: the multiplexed ``Generate`` stream, the one-request
``GenerateStream`` and ``ListModels``.

The method handlers are registered by hand (not with the generated ``add_..._to_server``)
so that the events a worker sends, parsed once as ``GenerateResponse``, go to the client
as they are: ``GenerateResponse`` and ``GenerateStreamResponse`` are the same on the wire.
Requests come in as raw bytes (no request deserializer) and are parsed by the handlers:
a message that is too large or cannot be parsed is INVALID_ARGUMENT, logged and counted,
instead of an exception inside gRPC.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
import structlog
from google.protobuf.message import Message

from draftwise.gateway.admit import Refused, Why, admit
from draftwise.gateway.bidi import MultiplexedStream
from draftwise.gateway.core import Core, InFlight
from draftwise.gateway.errors import RequestError
from draftwise.gateway.relay import Relay
from draftwise.gateway.resumption import UNKNOWN_HANDLE_METADATA, resume_relay
from draftwise.gateway.router import WorkerHandle
from draftwise.gateway.streams import Outbox
from draftwise.gateway.tenancy import metadata_key
from draftwise.gateway.validate import parse_request
from draftwise.v1 import generate_service_pb2 as gspb

log = structlog.get_logger("draftwise.gateway.service")
M = TypeVar("M", bound=Message)

SERVICE_NAME = "draftwise.v1.GenerateService"
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _serialize(message: gspb.GenerateResponse) -> bytes:
    return message.SerializeToString()


class GenerateServicer:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def Generate(  # noqa: N802 (gRPC method name)
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gspb.GenerateResponse]:
        async for resp in MultiplexedStream(self.core, context).run(requests):
            yield resp

    async def _parse(self, data: bytes, message_type: type[M], context: grpc.aio.ServicerContext, method: str) -> M:
        """``data`` parsed; a bad message ends the call with INVALID_ARGUMENT (logged, counted)."""
        try:
            return parse_request(data, message_type, self.core.config.max_request_bytes)
        except RequestError as e:
            self.core.metrics.requests.labels(e.code.name.lower()).inc()
            log.warning("bad message", method=method, bytes=len(data), error=e.message)
            await context.abort(e.code, e.message)
            raise  # (abort raises)

    async def GenerateStream(  # noqa: N802
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gspb.GenerateResponse]:
        core = self.core
        request = await self._parse(data, gspb.GenerateStreamRequest, context, "GenerateStream")
        if request.HasField("resume"):
            async for resp in self._resume(request, context):
                yield resp
            return
        start = request.start
        ticket = admit(core, start)
        if isinstance(ticket, Refused):
            if ticket.why == Why.AT_CAPACITY:  # the cheapest way out: no exception, the trailers built once
                admission = core.admission
                context.set_code(ticket.code)
                context.set_details(ticket.message)
                context.set_trailing_metadata(admission.trailing_metadata())
                return
            await context.abort(ticket.code, ticket.message)
            return  # (abort raises)
        rid = start.request_id or f"req-{uuid.uuid4().hex[:16]}"
        outbox = Outbox(core.config.max_buffered_tokens)
        salt = core.salts.for_key(metadata_key(context.invocation_metadata()))  # (gateway/tenancy.py)
        relay = Relay(core, rid, start, ticket, outbox, context.time_remaining(), salt)
        relay.start()
        async for resp in _events(relay, outbox, context):
            yield resp

    async def _resume(
        self, request: gspb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gspb.GenerateResponse]:
        core, r = self.core, request.resume
        relay = core.resumable.get(r.resume_handle)
        outbox = Outbox(core.config.max_buffered_tokens)
        try:
            if request.HasField("start"):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "GenerateStreamRequest has both start and resume: set one"
                )
            if core.draining:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "the server is shutting down; the request cannot be resumed here"
                )
            rid = r.request_id or (relay.start_request_id if relay is not None else "")
            resume_relay(core, relay, outbox, rid, r.next_token_index)
        except RequestError as e:
            core.metrics.requests.labels(e.code.name.lower()).inc()
            metadata: tuple[tuple[str, str | bytes], ...] = ()
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a paused request found no slot
                metadata = core.admission.trailing_metadata()
            elif e.code == grpc.StatusCode.NOT_FOUND and relay is None:  # another replica's handle, say
                metadata = UNKNOWN_HANDLE_METADATA
            await context.abort(e.code, e.message, metadata)
        assert relay is not None
        relay.on_takeover = outbox.close
        async for resp in _events(relay, outbox, context):
            yield resp

    async def ListModels(  # noqa: N802
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> gspb.ListModelsResponse:
        await self._parse(data, gspb.ListModelsRequest, context, "ListModels")
        infos = self.core.router.model_infos()
        if not infos:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no worker has reported its model yet ({self.core.router.describe()}); retry shortly",
            )
        return gspb.ListModelsResponse(
            models=[_model_info(name, w) for name, w in sorted(infos.items())],
            default_model=self.core.default_model() or "",
        )


async def _events(
    relay: InFlight, outbox: Outbox, context: grpc.aio.ServicerContext
) -> AsyncIterator[gspb.GenerateResponse]:
    """The events of ``relay`` from ``outbox``, until its final one: an error ends the call
    with its status. If the call goes away first, the request is kept for a resume (or aborted)."""
    try:
        while True:
            resp = await outbox.get()
            if resp is None:
                return
            kind = resp.event.WhichOneof("kind")
            if kind == "error":
                err = resp.event.error
                await context.abort(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.message)
            yield resp
            if kind == "finished":
                return
    finally:
        relay.client_gone(outbox)  # no-op once it ended or moved to another call


_SPEC_METHODS = {
    "draft": gspb.SPECULATIVE_METHOD_DRAFT_MODEL,
    "ngram": gspb.SPECULATIVE_METHOD_NGRAM,
    "eagle": gspb.SPECULATIVE_METHOD_EAGLE,
    "medusa": gspb.SPECULATIVE_METHOD_MEDUSA,
    "suffix": gspb.SPECULATIVE_METHOD_SUFFIX,
}
"""The worker's speculative method (GetLoad metadata) -> ModelInfo.speculative_method."""
_NAMED_DRAFTER = {gspb.SPECULATIVE_METHOD_DRAFT_MODEL, gspb.SPECULATIVE_METHOD_EAGLE, gspb.SPECULATIVE_METHOD_MEDUSA}
"""Methods with a drafter that has a name (a draft model, an EAGLE or Medusa head): ModelInfo.draft_model."""


def _model_info(name: str, w: WorkerHandle) -> gspb.ModelInfo:
    method = _SPEC_METHODS.get(w.speculative_method, gspb.SPECULATIVE_METHOD_UNSPECIFIED)
    return gspb.ModelInfo(
        name=name,
        max_model_len=w.max_model_len,
        has_draft=method != gspb.SPECULATIVE_METHOD_UNSPECIFIED,
        speculative_method=method,
        draft_model=w.draft_model if method in _NAMED_DRAFTER else "",
        num_speculative_tokens=w.num_speculative_tokens if method != gspb.SPECULATIVE_METHOD_UNSPECIFIED else 0,
    )


def add_generate_service(servicer: GenerateServicer, server: grpc.aio.Server) -> None:
    handlers = {
        # no request_deserializer: the handlers get bytes and parse them (see _parse)
        "Generate": grpc.stream_stream_rpc_method_handler(servicer.Generate, response_serializer=_serialize),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(servicer.GenerateStream, response_serializer=_serialize),
        "ListModels": grpc.unary_unary_rpc_method_handler(servicer.ListModels, response_serializer=_serialize),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
