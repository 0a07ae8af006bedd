"""Many requests on one ``Generate`` stream, blocking: the driver of :class:`SessionCore` with
threads, as the asyncio :class:`~draftwise_client.Session` is with tasks.

    with client.session() as s:
        a = s.generate("import os")
        b = s.generate("class Stack:")
        print(a.complete().text, b.complete().text)

A reader thread feeds the stream's messages to the core and queues each request's actions;
iterating a :class:`SyncRequestStream` (from any thread) carries them out. Messages to the server
go through a queue that the call's request iterator drains.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
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
    from draftwise_client._sync import Client

Outbox = queue.Queue[gspb.GenerateRequest | None]
"""Messages for the stream; None half-closes it."""


def _drain(outbox: Outbox) -> Iterator[gspb.GenerateRequest]:
    while (message := outbox.get()) is not None:
        yield message


class SyncRequestStream(RequestView):
    """The deltas of one request of a :class:`SyncSession` (an iterator)."""

    def __init__(self, session: SyncSession, request_id: str, start: pb.StartGeneration) -> None:
        self.session = session
        self.request_id = request_id
        self.core = RequestCore(
            start, retry=session.retry, resume=session.client.resume, deadline=session._core.deadline
        )
        self._queue: queue.Queue[Action] = queue.Queue()
        self._ready: deque[Delta] = deque()
        self._done = False

    def __iter__(self) -> SyncRequestStream:
        return self

    def __next__(self) -> Delta:
        while not self._ready:
            if self._done:
                raise StopIteration
            action = self._queue.get()
            if isinstance(action, Yield):
                self._ready.extend(action.deltas)
                self._done = action.final
            elif isinstance(action, Retry):  # refused before its first token: send it again
                time.sleep(action.delay_s)
                try:
                    self.session._send_start(self, action)
                except GenerationError:
                    self._done = True
                    raise
            else:
                self._done = True
                if isinstance(action, Raise):
                    raise action.error
        return self._ready.popleft()

    def cancel(self) -> None:
        """Ask the server to stop this request; its last delta then says "abort"."""
        self.session._cancel(self)

    def complete(self) -> Completion:
        acc = Collector()
        for delta in self:
            acc.add(delta)
        return acc.result()


class SyncSession:
    """One ``Generate`` stream carrying many requests, blocking. Closing it half-closes the
    stream and waits for the in-flight requests to finish; leaving it with an exception cancels
    them. Should the stream break (the connection dropped), the session opens a new one and
    resumes every in-flight request on it, as the client's ResumePolicy says; requests that had
    no delta yet are sent again."""

    def __init__(self, client: Client, timeout: float | None) -> None:
        self.client = client
        self._timeout = timeout
        self._core = SessionCore(client.resume)
        self._streams: dict[str, SyncRequestStream] = {}
        self._lock = threading.Lock()  # the core, the streams, the current call and its outbox
        self._call: grpc.Call | None = None
        self._outbox: Outbox = queue.Queue()
        self._responses: Iterator[gspb.GenerateResponse] = iter(())
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()
        self._stopped = False  # the reader ended: nothing more can be sent or received
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.retry = client.retry

    @property
    def reconnects(self) -> int:
        """Times the stream broke and the session opened a new one."""
        return self._core.reconnects

    def _open(self) -> None:
        """A new call with its own outbox (under the lock)."""
        self._outbox = queue.Queue()
        timeout = self._core.timeout(time.monotonic())
        call = self.client._stub.Generate(
            _drain(self._outbox), metadata=self.client.connection.metadata, timeout=timeout
        )
        self._call, self._responses = call, call

    def __enter__(self) -> SyncSession:
        self._core.deadline = None if self._timeout is None else time.monotonic() + self._timeout
        with self._lock:
            self._open()
        self._reader = threading.Thread(target=self._read, name=f"draftwise-session-{self._prefix}", daemon=True)
        self._reader.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._reader is not None and self._call is not None
        with self._lock:
            self._core.half_closed = True
            self._outbox.put(None)
            if exc_type is not None:
                self._closing.set()
                self._call.cancel()
        self._reader.join()

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        model: str = "",
        request_id: str | None = None,
    ) -> SyncRequestStream:
        """Start a request on the stream; iterate the returned SyncRequestStream for its deltas."""
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        stream = SyncRequestStream(self, rid, start_message(prompt, params, model, rid))
        self._send_start(stream)
        return stream

    def _send_start(self, stream: SyncRequestStream, retry: Retry | None = None) -> None:
        """Put ``stream``'s request in flight: its first attempt, or the one ``retry`` asked
        for (whose refusal is raised instead when it was cancelled or the session is over)."""
        with self._lock:  # registered and written together: a reconnection sees both or neither
            if self._reader is None or (self._core.half_closed and retry is None):
                raise RuntimeError("use the session inside `with client.session() as s:`")
            if retry is not None and (stream.core.cancelled or self._core.half_closed or self._stopped):
                raise retry.error
            if self._stopped:
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, STOPPED, stream.request_id)
            message = self._core.add(stream.core)
            self._streams[stream.request_id] = stream
            self._outbox.put(message)

    def _cancel(self, stream: SyncRequestStream) -> None:
        with self._lock:  # should the stream have broken, the reconnection sends the cancel again
            stream.core.cancel()
            self._outbox.put(cancel_request(stream.request_id))

    def _route(self, routes: Sequence[Route | Reconnect]) -> Reconnect | None:
        """Queue each request's action (under the lock); the session's own, if any."""
        for r in routes:
            if isinstance(r, Reconnect):
                return r
            if isinstance(r.action, Resume):  # its handle is unknown here: go on as a continuation
                log.info("continuing %s at token %d (%s)", r.request_id, r.action.next_index, r.action.error)
                self._outbox.put(session_request(r.action))
                continue
            stream = self._streams.get(r.request_id)
            if stream is not None:
                stream._queue.put(r.action)
                if not isinstance(r.action, Retry) and r.request_id not in self._core.requests:
                    del self._streams[r.request_id]  # over
        return None

    def _reconnect(self, cause: GenerationError) -> bool:
        """A new stream carrying every in-flight request: resumed where it has a handle,
        started again where it had no delta yet (nothing of it reached the caller). False when
        the session is being left with an exception (nothing is reopened)."""
        with self._lock:
            if self._closing.is_set():
                return False
            old = self._outbox
            self._open()
            old.put(None)  # lets the old call's request iterator end
            for message in self._core.reattach(cause):
                if message.HasField("resume"):
                    r = message.resume
                    log.info("resuming %s as %s at token %d", r.resume_handle, r.request_id, r.next_token_index)
                self._outbox.put(message)
            if self._core.half_closed:
                self._outbox.put(None)
            return True

    def _step(self, event: Received | Failed | Ended) -> Reconnect | None:
        with self._lock:
            return self._route(self._core.step(event, time.monotonic()))

    def _read(self) -> None:
        try:
            while True:
                try:
                    for resp in self._responses:
                        self._step(Received(resp.event))
                    self._step(Ended())
                    return
                except grpc.RpcError as e:
                    if self._closing.is_set():
                        return
                    reconnect = self._step(Failed.from_rpc(e))
                    if reconnect is None:
                        return
                    if self._closing.wait(reconnect.delay_s) or not self._reconnect(reconnect.error):
                        return
        finally:
            with self._lock:
                self._stopped = True
                closed = GenerationError(grpc.StatusCode.CANCELLED, CLOSED) if self._closing.is_set() else None
                self._route(self._core.fail_all(closed))
                self._outbox.put(None)
