"""The client's sans-IO core: what to do next for a request, or for a session's stream, given
what just happened. It makes no gRPC call, reads no clock, never sleeps and knows no asyncio:
the drivers (``_aio``, ``_sync`` and their sessions) do the I/O, pass the monotonic time in as
``now`` and carry out the actions returned. Both clients therefore retry, resume and give up
in exactly one way, and the tests can drive it with crafted events alone.

One request (:class:`RequestCore`)::

    begin()                      -> Send(start)
    Received(event)              -> Yield(deltas, final)   Yield(()) when a replay was dropped
                                    Raise(DATA_LOSS)       a gap, or a delta overlapping what came
                                    Retry(delay_s, start)  an error event before the first token
                                    Raise(error)           any other error event
    Failed(code, message, md)    -> Retry(delay_s, start)  refused before the first token
                                    Resume(delay_s, handle, next_index)   dropped after a delta
                                    Resume(0, start=continuation)  a resume after a drop was
                                        answered NOT_FOUND for an unknown handle (another gateway
                                        replica's): the start again, going on from the tokens held
                                    Raise(error)           not retryable, attempts used up, deadline
                                    Done()                 the final event had already arrived
    Ended()                      -> Done() / Raise(UNKNOWN) without a final event

A session's stream (:class:`SessionCore`) routes each event to its request's core
(``Route(request_id, action)``) and decides, when the stream fails, whether to reopen it
(``Reconnect(delay_s)``, then ``reattach()`` gives the messages for the new stream) or to fail
every request it carries.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from draftwise_client._proto import generate_service_pb2 as gspb
from draftwise_client._proto import generation_pb2 as pb
from draftwise_client._resume import (
    Progress,
    ResumePolicy,
    resume_delay,
    resume_outcome,
    transport_cause,
    unknown_handle,
)
from draftwise_client._retry import RetryPolicy, hint_from_metadata, retry_delay
from draftwise_client._types import Delta, GenerationError, delta_from_event

# -- events: what happened ---------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """A message arrived: one event of the request (on a session, of one of its requests)."""

    event: pb.GenerationEvent


@dataclass(frozen=True)
class Failed:
    """The call ended with an error status: its code, message and trailing metadata (where the
    server's retry hint travels)."""

    code: grpc.StatusCode
    message: str = ""
    metadata: tuple[tuple[str, str | bytes], ...] = ()

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> Failed:
        """The event for an error a gRPC call raised (sync or asyncio)."""
        code = getattr(e, "code", lambda: grpc.StatusCode.UNKNOWN)()
        details = getattr(e, "details", lambda: "")() or ""
        trailing = getattr(e, "trailing_metadata", lambda: None)()
        return cls(code, details, tuple(tuple(m) for m in trailing or ()))  # type: ignore[misc]


@dataclass(frozen=True)
class Ended:
    """The call ended OK: no more messages will come."""


Event = Received | Failed | Ended

# -- actions: what to do ------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send the request's start (its first attempt; on a session, again on a new stream)."""

    start: pb.StartGeneration
    attempt: int = 1


@dataclass(frozen=True)
class Retry:
    """Wait ``delay_s``, then send the start again as attempt number ``attempt``: ``error``
    refused the request before its first token."""

    start: pb.StartGeneration
    delay_s: float
    attempt: int
    error: GenerationError


@dataclass(frozen=True)
class Resume:
    """Wait ``delay_s``, then reconnect and resume the request with ``handle`` from token
    ``next_index`` (the count the caller holds): ``error`` dropped its connection."""

    handle: str
    next_index: int
    delay_s: float
    error: GenerationError
    request_id: str = ""
    """The id it goes by on a session's stream."""
    start: pb.StartGeneration | None = None
    """Set when the request goes on as a continuation instead: send this start (the original
    one with ``continuation`` = the tokens held) rather than a resume. The gateway answering
    did not know the handle (another replica's, or its retention passed)."""


@dataclass(frozen=True)
class Yield:
    """Hand ``deltas`` to the caller (none: a replayed event was dropped); ``final``: the
    request's last."""

    deltas: tuple[Delta, ...]
    final: bool = False


@dataclass(frozen=True)
class Raise:
    """Raise ``error`` to the caller: the request is over."""

    error: GenerationError


@dataclass(frozen=True)
class Done:
    """The request is over and nothing is missing: stop."""


Action = Send | Retry | Resume | Yield | Raise | Done


@dataclass(frozen=True)
class Route:
    """A session's action for one of its requests: hand ``action`` to ``request_id``'s reader."""

    request_id: str
    action: Action


@dataclass(frozen=True)
class Reconnect:
    """A session's action: wait ``delay_s``, open a new stream and write
    :meth:`SessionCore.reattach`'s messages on it; ``error`` broke the old one."""

    delay_s: float
    error: GenerationError


# -- wire messages of the actions -------------------------------------------------------------


def stream_request(action: Send | Retry | Resume) -> gspb.GenerateStreamRequest:
    """The GenerateStream call's request for ``action``."""
    if isinstance(action, Resume):
        if action.start is not None:
            return gspb.GenerateStreamRequest(start=action.start)
        resume = gspb.ResumeGeneration(resume_handle=action.handle, next_token_index=action.next_index)
        return gspb.GenerateStreamRequest(resume=resume)
    return gspb.GenerateStreamRequest(start=action.start)


def session_request(action: Send | Retry | Resume) -> gspb.GenerateRequest:
    """The Generate stream's message for ``action``."""
    if isinstance(action, Resume):
        if action.start is not None:
            return gspb.GenerateRequest(start=action.start)
        resume = gspb.ResumeGeneration(
            resume_handle=action.handle, next_token_index=action.next_index, request_id=action.request_id
        )
        return gspb.GenerateRequest(resume=resume)
    return gspb.GenerateRequest(start=action.start)


def cancel_request(request_id: str) -> gspb.GenerateRequest:
    return gspb.GenerateRequest(cancel=pb.CancelGeneration(request_id=request_id))


ENDED_EARLY = "the stream ended before this request finished"
CLOSED = "the session was closed"
STOPPED = "the session's stream has ended; open a new session"

# -- one request ------------------------------------------------------------------------------


class RequestCore:
    """One request's state machine: attempts, retries before its first token, resumes after
    it, and the tokens the caller holds (duplicates dropped, gaps refused)."""

    def __init__(
        self,
        start: pb.StartGeneration,
        *,
        retry: RetryPolicy,
        resume: ResumePolicy,
        deadline: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``deadline``: the monotonic time past which nothing is retried or resumed (None:
        none); ``rng``: the jitter's source (None: the ``random`` module)."""
        self.start = start
        self.request_id = start.request_id
        self.retry = retry
        self.resume = resume
        self.deadline = deadline
        self.rng = rng
        self.progress = Progress(self.request_id)
        """The resume handle and the index of the first token the caller lacks."""
        self.attempts = 0
        """Sends of the start so far."""
        self.cancelled = False
        """The caller asked to stop it: an error event then ends it, never retried."""
        self._in_row = 0  # resumes since the last event that reached the caller
        self.continuations = 0
        """Starts sent again as a continuation of the tokens held (a resume's handle was unknown)."""

    @property
    def resumes(self) -> int:
        """Resumes sent for it."""
        return self.progress.resumes

    @property
    def finished(self) -> bool:
        """Its final event reached the caller."""
        return self.progress.finished

    def timeout(self, now: float) -> float | None:
        """Seconds left until the deadline (the gRPC call's timeout); None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - now)

    def begin(self) -> Send:
        """The first attempt."""
        if self.attempts:
            raise RuntimeError(f"request {self.request_id!r} has already begun")
        self.attempts = 1
        return Send(self.start)

    def cancel(self) -> None:
        self.cancelled = True

    def step(self, event: Event, now: float) -> Action:
        """What to do after ``event``, at monotonic time ``now``."""
        if isinstance(event, Received):
            return self.received(event.event, now)
        if isinstance(event, Failed):
            return self.failed(event, now)
        return self.ended()

    def received(self, event: pb.GenerationEvent, now: float) -> Yield | Retry | Resume | Raise:
        """A message of the request arrived."""
        if event.WhichOneof("kind") == "error":
            return self._refused(event.error, now)
        try:
            fresh = self.progress.accept(event)
        except GenerationError as e:  # DATA_LOSS: a gap or an overlap
            e.attempts, e.resumes = self.attempts, self.resumes
            return Raise(e)
        if not fresh:
            return Yield(())
        self._in_row = 0
        delta = delta_from_event(event)
        return Yield((delta,), final=delta.finished)

    def failed(self, event: Failed, now: float) -> Retry | Resume | Raise | Done:
        """The call carrying the request ended with an error."""
        if self.progress.finished:
            return Done()  # the connection broke after the final event: nothing is missing
        error = self._error(event.code, event.message, hint_from_metadata(event.metadata))
        if self._elsewhere(error, event.metadata):
            return self._resume(0.0, error, elsewhere=True)
        if not self.progress.resumable:
            return self._retry_or_raise(error, now)
        self._in_row += 1
        delay = resume_delay(self.resume, error, self._in_row, self.deadline, now=now, rng=self.rng)
        if delay is None:  # the server's answer to a resume (NOT_FOUND, say), or resumes used up
            return Raise(resume_outcome(error, self.progress.cause))
        return self._resume(delay, error)

    def ended(self) -> Done | Raise:
        """The call carrying the request ended OK."""
        if self.progress.finished:
            return Done()
        return Raise(self._error(grpc.StatusCode.UNKNOWN, ENDED_EARLY))

    def reattach(self, cause: GenerationError) -> Send | Resume:
        """Its message for a session's new stream, ``cause`` having broken the old one: a
        resume where it has a handle, else its start again (nothing of it reached the caller)."""
        if self.progress.resumable:
            return self._resume(0.0, cause)
        self.attempts += 1
        return Send(self.start, self.attempts)

    def _error(self, code: grpc.StatusCode, message: str, hint_ms: int | None = None) -> GenerationError:
        error = GenerationError(code, message, self.request_id, hint_ms)
        error.attempts, error.resumes = self.attempts, self.resumes
        return error

    def _refused(self, err: pb.RequestError, now: float) -> Retry | Resume | Raise:
        """An error event (on a session's stream): the request ended there, unless it was
        refused before its first token and the RetryPolicy allows another attempt."""
        error = GenerationError.from_event(self.request_id, err)
        error.attempts, error.resumes = self.attempts, self.resumes
        if self._elsewhere(error):
            return self._resume(0.0, error, elsewhere=True)
        if self.progress.cause is not None:  # the answer to a resume
            return Raise(resume_outcome(error, self.progress.cause))
        if self.cancelled:
            return Raise(error)
        return self._retry_or_raise(error, now)

    def _retry_or_raise(self, error: GenerationError, now: float) -> Retry | Raise:
        received = self.progress.received
        delay = retry_delay(self.retry, error, self.attempts, received, self.deadline, now=now, rng=self.rng)
        if delay is None:
            return Raise(error)
        self.attempts += 1
        return Retry(self.start, delay, self.attempts, error)

    def _elsewhere(self, error: GenerationError, metadata: tuple[tuple[str, str | bytes], ...] = ()) -> bool:
        """Whether ``error``, the answer to a resume sent after the connection failed, says
        the gateway does not know the handle: the request goes on as a continuation, which
        any gateway can route (a resume after the server itself ended the request raises
        why it ended, as :func:`resume_outcome` says)."""
        p = self.progress
        return bool(p.handle) and transport_cause(p.cause) and unknown_handle(error, metadata)

    def _resume(self, delay: float, cause: GenerationError, *, elsewhere: bool = False) -> Resume:
        """A resume by handle; a continuation where ``elsewhere`` (the handle is unknown
        where the client reconnected) or where the last one was a continuation that has
        brought no handle yet. The answer to a continuation is not counted as a resume."""
        p = self.progress
        if not elsewhere:
            p.resumes += 1
        p.cause = p.cause or cause  # the first failure since the last event says why it ended
        if elsewhere or p.continued:
            self.continuations += 1
            start = p.continuation(self.start)
            return Resume("", p.next_index, delay, cause, self.request_id, start)
        return Resume(p.handle, p.next_index, delay, cause, self.request_id)


# -- a session's stream ---------------------------------------------------------------------------


class SessionCore:
    """The requests in flight on one ``Generate`` stream: routes events to them, and decides
    when a failed stream is reopened (as the ResumePolicy says, within the deadline)."""

    def __init__(self, resume: ResumePolicy, deadline: float | None = None, rng: random.Random | None = None) -> None:
        self.resume = resume
        self.deadline = deadline
        self.rng = rng
        self.requests: dict[str, RequestCore] = {}
        """In flight on the stream, by id (a request waiting to be retried is not)."""
        self.reconnects = 0
        """Times the stream was reopened."""
        self.half_closed = False
        """The caller will start no more requests: a new stream is half-closed at once."""
        self._in_row = 0  # reconnections since the last event

    def timeout(self, now: float) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - now)

    def add(self, request: RequestCore) -> gspb.GenerateRequest:
        """Put ``request`` in flight (its first attempt, or the one its Retry asked for) and
        return the message that sends it."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight on this stream")
        action = request.begin() if request.attempts == 0 else Send(request.start, request.attempts)
        self.requests[request.request_id] = request
        return session_request(action)

    def step(self, event: Event, now: float) -> Sequence[Route | Reconnect]:
        """What to do after ``event`` on the stream, at monotonic time ``now``."""
        if isinstance(event, Received):
            self._in_row = 0
            rid = event.event.request_id
            request = self.requests.get(rid)
            if request is None:
                return []  # one that ended already (a late replay, say)
            action = request.step(event, now)
            if isinstance(action, Yield) and not action.deltas:
                return []
            if isinstance(action, Resume):
                pass  # a continuation: it stays in flight, the driver writes it on this stream
            elif not isinstance(action, Yield) or action.final:
                del self.requests[rid]  # over, or out until its retry is sent
            return [Route(rid, action)]
        if isinstance(event, Ended):
            return self.fail_all(None)
        if not self.requests:
            return []
        error = GenerationError(event.code, event.message, "", hint_from_metadata(event.metadata))
        self._in_row += 1
        delay = resume_delay(self.resume, error, self._in_row, self.deadline, now=now, rng=self.rng)
        return self.fail_all(error) if delay is None else [Reconnect(delay, error)]

    def reattach(self, cause: GenerationError) -> list[gspb.GenerateRequest]:
        """The messages that carry every in-flight request over to a new stream."""
        self.reconnects += 1
        out: list[gspb.GenerateRequest] = []
        for rid, request in self.requests.items():
            out.append(session_request(request.reattach(cause)))
            if request.cancelled:
                out.append(cancel_request(rid))
        return out

    def fail_all(self, error: GenerationError | None) -> list[Route]:
        """Raise ``error`` (None: the stream ended early) to every request in flight."""
        routes: list[Route] = []
        for rid, request in self.requests.items():
            e = error or GenerationError(grpc.StatusCode.UNKNOWN, ENDED_EARLY)
            out = GenerationError(e.code, e.message, rid, e.retry_after_ms)
            out.attempts, out.resumes = request.attempts, request.resumes
            routes.append(Route(rid, Raise(out)))
        self.requests.clear()
        return routes
