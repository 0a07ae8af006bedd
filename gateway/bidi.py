"""One client's multiplexed ``Generate`` stream: many requests by request_id, each relayed
on its own task into the stream's :class:`Outbox`; a writer loop sends what the client
reads. A request's error is its own final event; the stream stays up.

Ends: client half-close -> the in-flight requests finish, then OK. Client cancels the call
(or its connection drops) -> every request that already sent its first delta (its resume
handle) is paused for the resume retention time (its admission slot given back, its worker
call cancelled, its tokens kept), waiting for a ``ResumeGeneration``; the others are aborted
(their worker calls cancelled). A ``cancel`` message aborts its request at once. Server shutdown -> in-flight
requests finish (or are ended with UNAVAILABLE when the grace period runs out), then the
call ends with UNAVAILABLE. A message that cannot be parsed (it has no request id to
answer) -> the in-flight requests are aborted and the call ends with INVALID_ARGUMENT at
once. The handler gets each message as raw bytes and parses it here (see
``validate.parse_request``): a deserializer that raised would leave the call unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import grpc
import structlog

from draftwise.gateway.admit import Refused, admit
from draftwise.gateway.config import MAX_RECEIVE_BYTES
from draftwise.gateway.core import Core, InFlight
from draftwise.gateway.errors import RequestError, clip, error_response
from draftwise.gateway.relay import Relay
from draftwise.gateway.resumption import resume_relay
from draftwise.gateway.streams import Outbox
from draftwise.gateway.tenancy import metadata_key
from draftwise.gateway.validate import parse_request, too_large
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb

log = structlog.get_logger("draftwise.gateway.stream")

_stream_ids = itertools.count()

DRAIN_BEFORE_END_S = 0.5
"""After a malformed message, how long the client's further messages are read and dropped
(until it half-closes) before the call ends with INVALID_ARGUMENT."""


async def _discard(requests: AsyncIterator[bytes]) -> None:
    async for _ in requests:
        pass


class MultiplexedStream:
    """State of one ``Generate`` call."""

    def __init__(self, core: Core, context: grpc.aio.ServicerContext) -> None:
        self.core = core
        self.context = context
        self.stream_id = next(_stream_ids)
        self.outbox = Outbox(core.config.max_buffered_tokens)
        self.active: dict[str, InFlight] = {}
        self.half_closed = False
        self.shutting_down = False
        self.fatal: RequestError | None = None  # what ends the whole call (a malformed message)
        # the caller's API key picks the prefix cache its requests may share (gateway/tenancy.py)
        self.cache_salt = core.salts.for_key(metadata_key(context.invocation_metadata()))
        self.log = log.bind(stream=self.stream_id)

    async def run(self, requests: AsyncIterator[bytes]) -> AsyncIterator[gspb.GenerateResponse]:
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
                relay.client_gone(self.outbox)  # kept for a resume, or aborted (its worker call cancelled)
        if self.fatal is not None:
            await self.context.abort(self.fatal.code, self.fatal.message)
        if self.shutting_down and not self.half_closed:
            await self.context.abort(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down; reconnect (to another instance) to go on"
            )

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        limit = self.core.config.max_request_bytes
        try:
            async for data in requests:
                try:
                    req = parse_request(data, gspb.GenerateRequest, MAX_RECEIVE_BYTES)
                except RequestError as e:
                    self._end_call(e, len(data))
                    # read (and drop) what the client already sent, briefly: a client whose
                    # write races with the call's status reports INTERNAL instead of the
                    # status (grpc/grpc#36066)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(_discard(requests), DRAIN_BEFORE_END_S)
                    self.outbox.close()
                    return
                if len(data) > limit:  # parsed only to answer the request it names
                    self._too_large(req, len(data), limit)
                    continue
                action = req.WhichOneof("action")
                if action == "start":
                    self.start(req.start)
                elif action == "cancel":
                    relay = self.active.get(req.cancel.request_id)
                    if relay is not None:
                        relay.cancel()  # unknown or finished ids are ignored, as the contract says
                elif action == "resume":
                    self.resume(req.resume)
                else:
                    self.outbox.put_final(
                        "",
                        error_response(
                            "",
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "GenerateRequest has none of start, cancel and resume",
                        ),
                    )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:  # the call is ending
            self.log.debug("stream read ended", error=str(e))
            return
        self.half_closed = True
        self._maybe_close()

    def _end_call(self, error: RequestError, size: int) -> None:
        """A message without a request id to answer: abort the stream's requests, end the call."""
        self.core.metrics.requests.labels(error.code.name.lower()).inc()
        self.log.warning("malformed message; ending the call", bytes=size, error=error.message)
        self.fatal = error
        for relay in list(self.active.values()):
            relay.cancel()

    def _too_large(self, req: gspb.GenerateRequest, size: int, limit: int) -> None:
        action = req.WhichOneof("action")
        rid = {"start": req.start.request_id, "cancel": req.cancel.request_id, "resume": req.resume.request_id}.get(
            action or "", ""
        )
        e = too_large(size, limit)
        self.core.metrics.requests.labels(e.code.name.lower()).inc()
        self.log.info("request too large", request_id=clip(rid), bytes=size, limit=limit)
        self.outbox.put_final(rid, error_response(rid, e.code, e.message))

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
                    f"request_id {clip(rid)!r} is already in flight on this stream; the new request was rejected "
                    "(the running one goes on): pick a fresh id",
                )
        except RequestError as e:
            self.core.metrics.requests.labels(e.code.name.lower()).inc()
            self.outbox.put_final(rid, error_response(rid, e.code, e.message))
            return
        ticket = admit(self.core, start)
        if isinstance(ticket, Refused):
            self.outbox.put_final(rid, error_response(rid, ticket.code, ticket.message, ticket.retry_after_ms))
            return
        relay = Relay(self.core, rid, start, ticket, self.outbox, self.context.time_remaining(), self.cache_salt)
        self.active[rid] = relay
        relay.start().add_done_callback(lambda _t, rid=rid, relay=relay: self._done(rid, relay))

    def resume(self, r: gspb.ResumeGeneration) -> None:
        """Attach the request of ``r.resume_handle`` to this stream (see ``Relay.resume``)."""
        relay = self.core.resumable.get(r.resume_handle)
        rid = r.request_id or (relay.start_request_id if relay is not None else "")
        try:
            running = self.active.get(rid)
            if running is not None and running is not relay and not running.done:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request_id {clip(rid)!r} is already in flight on this stream: resume under another id",
                )
            if self.core.draining:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "the server is shutting down; the request cannot be resumed here"
                )
            resume_relay(self.core, relay, self.outbox, rid, r.next_token_index)
        except RequestError as e:
            hint = self.core.admission.retry_after_ms if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else 0
            self.outbox.put_final(rid, error_response(rid, e.code, e.message, hint))
            return
        assert relay is not None and relay.task is not None
        self.active[rid] = relay
        relay.on_takeover = lambda rid=rid, relay=relay: self._done(rid, relay)
        relay.task.add_done_callback(lambda _t, rid=rid, relay=relay: self._done(rid, relay))

    def _done(self, rid: str, relay: InFlight) -> None:
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
