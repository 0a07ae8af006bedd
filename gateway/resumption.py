"""Resumable requests: a request outlives its client stream.

Every request relayed with a replay buffer (:mod:`draftwise.gateway.replay`) gets a resume
handle on its first delta. When its client goes away (:meth:`Resumable.client_gone`) it is
paused for ``resume_retention_s``: it gives back its admission slot and its worker call is
cancelled (the worker frees its KV blocks), while its events stay in the buffer. A
``ResumeGeneration`` with the handle and the index of the next token wanted
(:func:`resume_relay`) re-admits it (RESOURCE_EXHAUSTED, as for a new request, when every slot
is taken), replays what the client missed into the new stream and goes on live there, as a
continuation of the tokens so far on any worker (randomness is a function of seed and
position: greedy and seeded requests go on exactly). A resume on another stream while the old
one is still open takes the request over (the old stream gets ABORTED). Without a resume in
time the request is cancelled and forgotten.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import grpc

from draftwise.gateway.core import Core, InFlight
from draftwise.gateway.errors import RequestError, error_response
from draftwise.gateway.replay import ReplayBuffer, ResumeError
from draftwise.gateway.streams import Outbox

UNKNOWN_HANDLE_METADATA = (("draftwise-resume-reason", "unknown-handle"),)
"""Trailing metadata of a GenerateStream resume refused because this gateway does not know the
handle (another replica's, or its retention passed), as opposed to a known request that can no
longer be resumed: the client may then start the request again as a continuation of the tokens
it holds, which any gateway can route. (The message begins "no request with this resume
handle" on both RPCs; a session's error event carries no metadata.)"""


def resume_relay(core: Core, relay: InFlight | None, outbox: Outbox, request_id: str, next_token_index: int) -> None:
    """Attach ``relay`` (the request of a resume handle, None when unknown) to ``outbox``;
    RequestError NOT_FOUND or INVALID_ARGUMENT when it cannot be (counted by outcome)."""
    resumes = core.metrics.resumes
    if relay is None:
        resumes.labels("not_found").inc()
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            "no request with this resume handle on this gateway: it was never started here, its client was gone "
            f"for longer than the retention time ({core.config.resume_retention_s:g}s, --resume-retention-s), or "
            "it finished and its events were delivered",
        )
    try:
        relay.resume(outbox, request_id, next_token_index)
    except ResumeError as e:
        resumes.labels(e.code).inc()
        raise RequestError(_RESUME_CODES[e.code], e.message) from None
    resumes.labels("ok").inc()


_RESUME_CODES = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""The status of a resume refused for each ResumeError code (RESOURCE_EXHAUSTED: no admission
slot for a paused request; the caller adds the retry hint)."""


class Resumable(ABC):
    """The part of a request that deals with its client coming and going: the stream it
    sends to (``outbox``, under ``request_id``), its resume handle and replay buffer, and the
    retention timer while no client is attached. :class:`~draftwise.gateway.relay.Relay`
    is the request; it hands out the handle and fills the buffer as events pass."""

    log: Any  # the request's bound logger (set by the subclass)

    def __init__(self, core: Core, request_id: str, outbox: Outbox | None, num_tokens: int) -> None:
        self.core = core
        self.request_id = request_id
        self.outbox = outbox
        self.start_request_id = request_id  # what a resume with an empty request_id uses
        self.handle = ""
        self.buffer: ReplayBuffer | None = None
        if core.config.resume_retention_s > 0:
            self.buffer = ReplayBuffer(core.replay_budget, core.config.resume_buffer_bytes, num_tokens=num_tokens)
        self._expiry: asyncio.TimerHandle | None = None
        # while its client is gone (kept for a resume): no slot, no worker call; set when resumed
        self._paused = False
        self._resumed = asyncio.Event()
        self.on_takeover: Callable[[], None] | None = None
        """Called when a resume on another stream takes this request over (its stream forgets it)."""

    @property
    @abstractmethod
    def done(self) -> bool:
        """Whether the request has its final event."""

    @property
    @abstractmethod
    def cancelling(self) -> bool:
        """Whether the request was asked to end (``cancel``)."""

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Output tokens sent to the client so far."""

    @abstractmethod
    def cancel(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, message: str = "") -> None:
        """End the request now (its worker call is cancelled)."""

    @abstractmethod
    def _hold(self, on: bool) -> None:
        """Take (``on``: its slot already acquired) or give back its admission slot and its
        place among the requests in flight."""

    @abstractmethod
    def _stop_call(self) -> None:
        """Cancel its worker call in progress, if any (the worker frees the request's KV)."""

    @property
    def paused(self) -> bool:
        """Whether it is paused (no admission slot, no worker call) until a resume."""
        return self._paused

    def pause(self) -> None:
        """Its client went away and it is kept for a resume: give back its admission slot and
        stop its worker call; the tokens so far stay (:meth:`unpause` goes on from them)."""
        if self._paused or self.done or self.cancelling:
            return
        self._paused = True
        self._resumed.clear()
        self._hold(False)
        self._stop_call()
        self.log.info("paused", tokens=self.num_tokens)

    def unpause(self) -> None:
        """Go on after a pause (the caller acquired an admission slot for it)."""
        if not self._paused:
            return
        self._paused = False
        self._hold(True)
        self._resumed.set()

    @property
    def detached(self) -> bool:
        """Whether it is kept for a resume (its client gone, the retention time running)."""
        return self._expiry is not None

    def client_gone(self, outbox: Outbox) -> None:
        """The client stream behind ``outbox`` went away. A resumable request is paused (it
        holds no admission slot and no worker compute), its events kept for a resume, for
        ``resume_retention_s``; any other is cancelled."""
        if self.outbox is not outbox or self.done or self.cancelling:
            return
        buf = self.buffer
        if not self.handle or buf is None or buf.lost is not None:
            self.cancel()  # the client has no handle, or there is nothing to resume from
            return
        self.outbox = None
        retention = self.core.config.resume_retention_s
        self._expiry = asyncio.get_running_loop().call_later(retention, self._expire)
        self.core.metrics.detached.inc()
        self.log.info("client gone; request kept for a resume", tokens=self.num_tokens, retention_s=retention)
        self.pause()

    def _expire(self) -> None:
        """Retention passed without a resume: cancel the request (its KV is freed), forget it."""
        self._expiry = None
        self.core.metrics.detached.dec()
        self.log.info("resume retention passed; request dropped", running=not self.done)
        self.cancel()
        self._unregister("its retention time passed")

    def resume(self, outbox: Outbox, request_id: str, next_token_index: int) -> None:
        """Send the events from ``next_token_index`` on into ``outbox`` as ``request_id``, then
        the live rest (a paused request takes an admission slot and goes on). ResumeError when
        that index is not a boundary or beyond what was produced, or when a paused request finds
        no free slot (it stays paused: the client may retry within the retention time)."""
        assert self.buffer is not None  # only buffered requests are registered
        events = self.buffer.replay(next_token_index, request_id)
        admission = self.core.admission
        restart = self.paused and not self.done
        if restart and not admission.try_acquire():
            raise ResumeError("resource_exhausted", admission.rejection())
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
            self.core.metrics.detached.dec()
        elif self.outbox is not None and self.outbox is not outbox:  # its old stream has not noticed yet
            old, old_rid = self.outbox, self.request_id
            old.put_final(
                old_rid,
                error_response(
                    old_rid,
                    grpc.StatusCode.ABORTED,
                    "this request was resumed on another connection (ResumeGeneration)",
                ),
            )
            if self.on_takeover is not None:
                self.on_takeover()
        self.outbox, self.request_id = outbox, request_id
        self.on_takeover = None
        self.log = self.log.bind(request_id=request_id)
        for r in events:
            outbox.put_replay(request_id, r)
        self.log.info("resumed", next_token_index=next_token_index, replayed=len(events), done=self.done)
        if restart:
            self.unpause()
        if self.done:
            self._unregister("it finished and its events were delivered")

    def _unregister(self, why: str) -> None:
        if self.handle and self.core.resumable.get(self.handle) is self:
            del self.core.resumable[self.handle]
        if self.buffer is not None:
            self.buffer.drop(why)
