"""Many requests on one ``Generate`` stream, with asyncio: the driver of :class:`SessionCore`.

    async with client.session() as s:
        a = await s.generate("import os")
        b = await s.generate("class Stack:")
        print((await a.complete()).text, (await b.complete()).text)

A reader task feeds the stream's messages to the core and queues each request's actions;
iterating a :class:`RequestStream` carries them out (a retry waits and sends again there).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import grpc

from draftwise_client._common import RequestView
from draftwise_client._core import (
    CLOSED,
    STOPPED,
    Action,
    Ended,
    Failed,
    Raise,
    Received,
    Reconnect,
    RequestCore,
    Resume,
    Retry,
    Route,
    SessionCore,
    Yield,
    cancel_request,
    session_request,
)
from draftwise_client._proto import generate_service_pb2 as gspb
from draftwise_client._proto import generation_pb2 as pb
from draftwise_client._resume import log
from draftwise_client._types import Collector, Completion, Delta, GenerationError, SamplingParams, start_message

if TYPE_CHECKING:
    from draftwise_client._aio import AsyncClient


class RequestStream(RequestView):
    """The deltas of one request of a :class:`Session` (an async iterator)."""

    def __init__(self, session: Session, request_id: str, start: pb.StartGeneration) -> None:
        self.session = session
        self.request_id = request_id
        self.core = RequestCore(
            start, retry=session.retry, resume=session.client.resume, deadline=session._core.deadline
        )
        self._queue: asyncio.Queue[Action] = asyncio.Queue()
        self._ready: deque[Delta] = deque()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        while not self._ready:
            if self._done:
                raise StopAsyncIteration
            action = await self._queue.get()
            if isinstance(action, Yield):
                self._ready.extend(action.deltas)
                self._done = action.final
            elif isinstance(action, Retry):  # refused before its first token: send it again
                await asyncio.sleep(action.delay_s)
                try:
                    await self.session._send_start(self, action)
                except GenerationError:
                    self._done = True
                    raise
            else:
                self._done = True
                if isinstance(action, Raise):
                    raise action.error
        return self._ready.popleft()

    async def cancel(self) -> None:
        """Ask the server to stop this request; its last delta then says "abort"."""
        self.core.cancel()
        # should the stream have broken, the session's reconnection sends the cancel again
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.session._write(cancel_request(self.request_id))

    async def complete(self) -> Completion:
        acc = Collector()
        async for delta in self:
            acc.add(delta)
        return acc.result()


class Session:
    """One ``Generate`` stream carrying many requests. Closing it half-closes the stream and
    waits for the in-flight requests to finish. Should the stream break (the connection
    dropped), the session opens a new one and resumes every in-flight request on it, as the
    client's ResumePolicy says; requests that had no delta yet are sent again."""

    def __init__(self, client: AsyncClient, timeout: float | None) -> None:
        self.client = client
        self._call: grpc.aio.StreamStreamCall | None = None
        self._timeout = timeout
        self._core = SessionCore(client.resume)
        self._streams: dict[str, RequestStream] = {}
        self._to_write: list[gspb.GenerateRequest] = []  # continuations the reader writes next
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._write_lock = asyncio.Lock()
        self._stopped = False  # the reader ended: nothing more can be sent or received
        self.retry = client.retry

    @property
    def reconnects(self) -> int:
        """Times the stream broke and the session opened a new one."""
        return self._core.reconnects

    def _open(self) -> grpc.aio.StreamStreamCall:
        timeout = self._core.timeout(time.monotonic())
        return self.client._stub.Generate(metadata=self.client.connection.metadata, timeout=timeout)

    async def __aenter__(self) -> Session:
        self._core.deadline = None if self._timeout is None else time.monotonic() + self._timeout
        self._call = self._open()
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._call is not None and self._reader is not None
        if exc_type is None:
            async with self._write_lock:
                self._core.half_closed = True
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await self._call.done_writing()
            await self._reader
        else:
            self._call.cancel()
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _write(self, message: gspb.GenerateRequest) -> None:
        if self._call is None:
            raise RuntimeError("use the session inside `async with client.session() as s:`")
        async with self._write_lock:
            await self._call.write(message)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        model: str = "",
        request_id: str | None = None,
    ) -> RequestStream:
        """Start a request on the stream; iterate the returned RequestStream for its deltas."""
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid, start_message(prompt, params, model, rid))
        await self._send_start(stream)
        return stream

    async def _send_start(self, stream: RequestStream, retry: Retry | None = None) -> None:
        """Put ``stream``'s request in flight: its first attempt, or the one ``retry`` asked
        for (whose refusal is raised instead when it was cancelled or the session is over)."""
        if self._call is None or (self._core.half_closed and retry is None):
            raise RuntimeError("use the session inside `async with client.session() as s:`")
        async with self._write_lock:  # registered and written together: a reconnection sees both or neither
            if retry is not None and (stream.core.cancelled or self._core.half_closed or self._stopped):
                raise retry.error
            if self._stopped:
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, STOPPED, stream.request_id)
            message = self._core.add(stream.core)
            self._streams[stream.request_id] = stream
            # a broken stream: the reader reopens it (and sends this again) or fails the request
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self._call.write(message)

    def _route(self, routes: Sequence[Route | Reconnect]) -> Reconnect | None:
        """Queue each request's action; the session's own (a reconnection), if any."""
        for r in routes:
            if isinstance(r, Reconnect):
                return r
            if isinstance(r.action, Resume):  # its handle is unknown here: go on as a continuation
                log.info("continuing %s at token %d (%s)", r.request_id, r.action.next_index, r.action.error)
                self._to_write.append(session_request(r.action))
                continue
            stream = self._streams.get(r.request_id)
            if stream is not None:
                stream._queue.put_nowait(r.action)
                if not isinstance(r.action, Retry) and r.request_id not in self._core.requests:
                    del self._streams[r.request_id]  # over
        return None

    async def _flush(self) -> None:
        """Write the continuations the routing asked for (a broken stream: read says so, and
        the reconnection carries them over)."""
        async with self._write_lock:
            messages, self._to_write = self._to_write, []
            assert self._call is not None
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                for message in messages:
                    await self._call.write(message)

    async def _reconnect(self, cause: GenerationError) -> None:
        """A new stream carrying every in-flight request: resumed where it has a handle,
        started again where it had no delta yet (nothing of it reached the caller)."""
        async with self._write_lock:
            self._call = self._open()
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):  # read says so
                for message in self._core.reattach(cause):
                    if message.HasField("resume"):
                        r = message.resume
                        log.info("resuming %s as %s at token %d", r.resume_handle, r.request_id, r.next_token_index)
                    await self._call.write(message)
                if self._core.half_closed:
                    await self._call.done_writing()

    async def _read(self) -> None:
        assert self._call is not None
        core = self._core
        try:
            while True:
                try:
                    async for resp in self._call:
                        self._route(core.step(Received(resp.event), time.monotonic()))
                        if self._to_write:
                            await self._flush()
                    self._route(core.step(Ended(), time.monotonic()))
                    return
                except grpc.aio.AioRpcError as e:
                    reconnect = self._route(core.step(Failed.from_rpc(e), time.monotonic()))
                    if reconnect is None:
                        return
                    await asyncio.sleep(reconnect.delay_s)
                    await self._reconnect(reconnect.error)
        except asyncio.CancelledError:
            self._route(core.fail_all(GenerationError(grpc.StatusCode.CANCELLED, CLOSED)))
        finally:
            self._stopped = True
            self._route(core.fail_all(None))  # (none left, unless the reader itself failed)
