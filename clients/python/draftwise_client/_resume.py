"""Resuming a request whose connection dropped mid-stream.

Every request's first delta carries a resume handle (``TokenDelta.resume_handle``). When the
transport fails after that (UNAVAILABLE: connection refused or reset, the gateway went away;
the call torn down under the client), the client reconnects and sends
``ResumeGeneration(resume_handle, next_token_index)`` with the count of tokens it already
handed to the caller; the gateway replays what followed from its buffer and goes on live.
The caller sees one uninterrupted stream. A gateway that does not know the handle (the
reconnection landed on another replica, or the retention time passed) answers NOT_FOUND; the
client then sends the request's start again with the tokens it holds as its ``Continuation``,
which any gateway routes, and the stream goes on at the same index. Attempts are bounded and spaced by an exponential
backoff with jitter; :meth:`ResumePolicy.off` (or ``resume=None`` on a client) turns it off.

A refusal *before* the first delta is not a resume: that is :class:`RetryPolicy`'s business.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import grpc

from draftwise_client._proto import generate_service_pb2 as gspb
from draftwise_client._proto import generation_pb2 as pb
from draftwise_client._types import GenerationError

log = logging.getLogger("draftwise_client")

TRANSPORT_DETAILS = (
    "Internal error from Core",
    "Stream removed",
    "Socket closed",
    "Connection reset",
    "failed to connect",
    "recvmsg",
)
"""Details gRPC core gives a call that the transport tore down under it (reported as INTERNAL
or UNKNOWN rather than UNAVAILABLE, depending on where the connection broke)."""


@dataclass(frozen=True)
class ResumePolicy:
    """How a client resumes a request whose connection dropped after its first delta.
    ``ResumePolicy.off()`` (or ``resume=None`` on a client) turns resuming off."""

    max_attempts: int = 5
    """Reconnections in a row without a new event before the error is raised (0: never resume)."""
    initial_backoff_s: float = 0.05
    """Delay before the first reconnection."""
    max_backoff_s: float = 2.0
    """Upper bound of the exponential delay."""
    multiplier: float = 2.0
    """Growth of the delay from one reconnection to the next."""
    jitter: float = 0.2
    """Each delay is stretched by a random factor in [1, 1 + jitter]."""

    def __post_init__(self) -> None:
        if self.max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1 or self.jitter < 0:
            raise ValueError("need multiplier >= 1 and jitter >= 0")

    @classmethod
    def off(cls) -> ResumePolicy:
        """Never resume: a dropped connection raises at once."""
        return cls(max_attempts=0)

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before reconnection number ``attempt`` (1 for the first)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (1 + self.jitter * (rng or random).random())


DEFAULT_RESUME = ResumePolicy()
"""The clients' default: up to 5 reconnections in a row, 0.05 s doubling to at most 2 s."""


def is_transport_error(error: GenerationError) -> bool:
    """Whether ``error`` says the connection failed (rather than the server ending the request)."""
    if error.code == grpc.StatusCode.UNAVAILABLE:
        return True
    if error.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return any(d in error.message for d in TRANSPORT_DETAILS)
    return False


def resume_delay(
    policy: ResumePolicy,
    error: GenerationError,
    attempt: int,
    deadline: float | None = None,
    *,
    now: float | None = None,
    rng: random.Random | None = None,
) -> float | None:
    """Seconds to wait before reconnection number ``attempt`` after ``error``; None when the
    error is not a transport failure, attempts are used up, or the wait would pass
    ``deadline`` (a monotonic time; ``now``: the current one, read from the clock when None)."""
    if not is_transport_error(error) or attempt > policy.max_attempts:
        return None
    delay = policy.delay_s(attempt, rng)
    if deadline is not None and (time.monotonic() if now is None else now) + delay >= deadline:
        return None
    return delay


UNKNOWN_HANDLE = "no request with this resume handle"
"""How the gateway's NOT_FOUND for a handle it does not know begins (on a session's error
event, where no metadata travels)."""
RESUME_REASON_KEY = "draftwise-resume-reason"
"""Trailing metadata of a refused resume: ``unknown-handle`` when the gateway answering does
not know the handle (another replica's, or its retention time passed)."""


def unknown_handle(error: GenerationError, metadata: tuple[tuple[str, str | bytes], ...] = ()) -> bool:
    """Whether ``error`` (the answer to a resume) says that the gateway does not know the
    handle, rather than that the request cannot be resumed (its events lost, say)."""
    if error.code != grpc.StatusCode.NOT_FOUND:
        return False
    if any(k == RESUME_REASON_KEY and v in ("unknown-handle", b"unknown-handle") for k, v in metadata):
        return True
    return error.message.startswith(UNKNOWN_HANDLE)


def transport_cause(cause: GenerationError | None) -> bool:
    """Whether ``cause`` (what made the client resume) was the connection failing, not the
    server ending the request with UNAVAILABLE itself."""
    return cause is not None and is_transport_error(cause) and cause.message.startswith(TRANSPORT_DETAILS)


def resume_outcome(error: GenerationError, cause: GenerationError | None) -> GenerationError:
    """The error to raise when a resume sent after ``cause`` failed with ``error``. A resume
    that finds nothing (NOT_FOUND) after an UNAVAILABLE the server itself sent (the request
    ended there: no worker could take it over, say) raises that UNAVAILABLE: it says why
    the request ended. Any other answer is raised as it is."""
    if cause is None or error.code != grpc.StatusCode.NOT_FOUND or cause.message.startswith(TRANSPORT_DETAILS):
        return error  # (after a plain transport failure, NOT_FOUND says it: retention passed, say)
    out = GenerationError(cause.code, cause.message, cause.request_id, cause.retry_after_ms)
    out.attempts, out.resumes = error.attempts, error.resumes
    return out


class Progress:
    """What the caller has of one request: its resume handle and the index of the first token
    it has not received. Filters the events of a resumed stream so that nothing is seen twice."""

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self.handle = ""
        self.next_index = 0
        self.received = False
        """An event of the request reached the caller."""
        self.finished = False
        """Its final event reached the caller."""
        self.resumes = 0
        """Resumes sent for it."""
        self.cause: GenerationError | None = None
        """The error that made the client resume it, until an event arrives after the resume."""
        self.token_ids: list[int] = []
        """Every token handed to the caller, in order (what a continuation goes on from)."""
        self.speculation: pb.SpeculationStats | None = None
        """The latest speculation counters a delta carried (cumulative)."""
        self.continued = False
        """The request was sent again as a continuation and its new handle has not come yet."""

    @property
    def resumable(self) -> bool:
        """It can be resumed: it has a handle, or it was sent again as a continuation (which
        can be sent again)."""
        return bool(self.handle) or self.continued

    def continuation(self, start: pb.StartGeneration) -> pb.StartGeneration:
        """``start`` going on from the tokens the caller holds (``Continuation``): any gateway
        can route it, and its first delta has ``first_token_index`` = the count held. The
        handle is forgotten; the first delta of the continuation brings a new one."""
        out = pb.StartGeneration()
        out.CopyFrom(start)
        cont = out.continuation
        del cont.output_token_ids[:]
        cont.output_token_ids.extend(self.token_ids)
        if self.speculation is not None:
            cont.speculation.CopyFrom(self.speculation)
        self.handle, self.continued = "", True
        return out

    def accept(self, event: pb.GenerationEvent) -> bool:
        """Record ``event``; False for a delta the caller already has (drop it). Raises
        GenerationError(DATA_LOSS) on a gap or a delta that overlaps what was received."""
        self.cause = None
        kind = event.WhichOneof("kind")
        if kind != "delta":
            if kind == "finished":  # (an error event may be followed by a retry: not final here)
                if self.finished:
                    return False
                self.received = self.finished = True
            return True
        d = event.delta
        if d.resume_handle and not self.handle:
            self.handle, self.continued = d.resume_handle, False
        end = d.first_token_index + len(d.token_ids)
        if d.first_token_index == self.next_index:
            self.next_index = end
            self.received = True
            self.token_ids.extend(d.token_ids)
            if d.HasField("speculation"):
                self.speculation = pb.SpeculationStats()
                self.speculation.CopyFrom(d.speculation)
            return True
        if end <= self.next_index and d.token_ids:
            return False  # a replayed delta the caller already has
        raise GenerationError(
            grpc.StatusCode.DATA_LOSS,
            f"delta at token {d.first_token_index} (+{len(d.token_ids)}) after {self.next_index} tokens received",
            self.request_id,
        )

    def resume_message(self, request_id: str = "") -> gspb.ResumeGeneration:
        return gspb.ResumeGeneration(resume_handle=self.handle, next_token_index=self.next_index, request_id=request_id)
