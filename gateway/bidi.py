"""One client's multiplexed ``Generate`` stream: many requests by request_id, each relayed
on its own task into the stream's :class:`Outbox`; a writer loop sends what the client
reads. A request's error is its own final event; the stream stays up.

Ends: client half-close -> the in-flight requests finish, then OK. Client cancels the call
-> every request is aborted (its worker call cancelled). Server shutdown -> in-flight
requests finish (or are ended with UNAVAILABLE when the grace period runs out), then the
call ends with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
import structlog

from draftwise.gateway.relay import Core, Relay, RequestError, error_response
from draftwise.gateway.streams import Outbox
from draftwise.gateway.validate import validate_start
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb

log = structlog.get_logger("draftwise.gateway.stream")

_stream_ids = itertools.count()


class MultiplexedStream:
    """State of one ``Generate`` call."""

    def __init__(self, core: Core, context: grpc.aio.ServicerContext) -> None:
        self.core = core
        self.context = context
        self.stream_id = next(_stream_ids)
        self.outbox = Outbox(core.config.max_buffered_tokens)
        self.active: dict[str, Relay] = {}
        self.half_closed = False
        self.shutting_down = False
        self.log = log.bind(stream=self.stream_id)

    async def run(self, requests: AsyncIterator[gspb.GenerateRequest]) -> AsyncIterator[gspb.GenerateResponse]:
        """The responses of the call (the servicer yields them)."""
        streams = self.core.streams
        streams.add(self)
        self.core.metrics.streams_open.inc()
        reader = asyncio.create_task(self._read(requests), name=f"stream-{self.stream_id}-reader")
        try:
            outbox = self.outbox
            while True:
                resp = await outbox.get()
                if resp is None:
                    break
                yield resp
                if self.outbox.num_coalesced:
                    self.core.metrics.coalesced.inc(self.outbox.num_coalesced)
                    self.outbox.num_coalesced = 0
        finally:
            streams.discard(self)
            self.core.metrics.streams_open.dec()
            reader.cancel()
            for relay in list(self.active.values()):
                relay.cancel()  # the call is over: abort what is left (their worker calls are cancelled)
        if self.shutting_down and not self.half_closed:
            await self.context.abort(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down; reconnect (to another instance) to go on"
            )

    async def _read(self, requests: AsyncIterator[gspb.GenerateRequest]) -> None:
        try:
            async for req in requests:
                action = req.WhichOneof("action")
                if action == "start":
                    self.start(req.start)
                elif action == "cancel":
                    relay = self.active.get(req.cancel.request_id)
                    if relay is not None:
                        relay.cancel()  # unknown or finished ids are ignored, as the contract says
                else:
                    self.outbox.put_final(
                        "",
                        error_response(
                            "", grpc.StatusCode.INVALID_ARGUMENT, "GenerateRequest has neither start nor cancel"
                        ),
                    )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:  # the call is ending
            self.log.debug("stream read ended", error=str(e))
            return
        self.half_closed = True
        self._maybe_close()

    def start(self, start: pb.StartGeneration) -> None:
        rid = start.request_id
        try:
            if not rid:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "request_id is empty: on the Generate stream every request needs an id unique among its in-flight requests",
                )
            running = self.active.get(rid)
            if running is not None and not running.done:  # (a finished one may linger until its callback runs)
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request_id {rid!r} is already in flight on this stream; the new request was rejected "
                    "(the running one goes on): pick a fresh id",
                )
            if self.core.draining:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "the server is shutting down; send it to another instance"
                )
            model = validate_start(self.core, start)
            if not self.core.admission.try_acquire():
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, self.core.admission.rejection())
        except RequestError as e:
            self.core.metrics.requests.labels(e.code.name.lower()).inc()
            self.outbox.put_final(rid, error_response(rid, e.code, e.message))
            return
        relay = Relay(self.core, rid, start, model, self.outbox, self.context.time_remaining())
        self.active[rid] = relay
        relay.start().add_done_callback(lambda _t, rid=rid, relay=relay: self._done(rid, relay))

    def _done(self, rid: str, relay: Relay) -> None:
        if self.active.get(rid) is relay:
            del self.active[rid]
        self._maybe_close()

    def _maybe_close(self) -> None:
        if (self.half_closed or self.shutting_down) and not self.active:
            self.outbox.close()

    def shutdown(self) -> None:
        """Server shutdown: take no new requests; end once the in-flight ones are done."""
        self.shutting_down = True
        self._maybe_close()
