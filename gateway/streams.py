"""Backpressure: the bounded, coalescing queue of events waiting for one client stream.

Worker relays put events without ever waiting; the stream's writer takes them out at the
pace the client reads. While a client keeps up, every delta goes out as it came. When it
falls behind, a request's consecutive queued deltas merge into one (token ids, text and
logprobs concatenated, the first ``first_token_index`` kept), so the queue holds at most
one delta and one final event per request; once a request's merged delta passes
``max_buffered_tokens``, ``put_delta`` says so and the relay cancels that request with
RESOURCE_EXHAUSTED. Nothing here ever blocks a producer.
"""

from __future__ import annotations

import asyncio
from collections import deque

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb


def merge_delta(into: pb.TokenDelta, new: pb.TokenDelta) -> None:
    """Append ``new`` to ``into`` as if the worker had sent them as one delta."""
    into.token_ids.extend(new.token_ids)
    into.text += new.text
    if len(new.logprobs):
        into.logprobs.extend(new.logprobs)
    if new.HasField("speculation"):  # cumulative counters: the latest wins
        into.speculation.CopyFrom(new.speculation)


class Outbox:
    """Events for one client stream, in order per request; deltas coalesce while queued."""

    def __init__(self, max_buffered_tokens: int) -> None:
        self.max_buffered_tokens = max_buffered_tokens
        self._queue: deque[gspb.GenerateResponse] = deque()
        self._open_delta: dict[str, gspb.GenerateResponse] = {}  # request id -> its queued, mergeable delta
        self._ready = asyncio.Event()
        self._closed = False
        self.num_coalesced = 0
        """Deltas merged into an earlier queued one (a sign the reader fell behind)."""

    def __len__(self) -> int:
        return len(self._queue)

    def put_delta(self, request_id: str, response: gspb.GenerateResponse) -> bool:
        """Queue a delta event of ``request_id``; False when that request now has more than
        ``max_buffered_tokens`` tokens queued (the event is queued anyway)."""
        queued = self._open_delta.get(request_id)
        if queued is not None:
            merge_delta(queued.event.delta, response.event.delta)
            self.num_coalesced += 1
            return len(queued.event.delta.token_ids) <= self.max_buffered_tokens
        self._queue.append(response)
        self._open_delta[request_id] = response
        self._ready.set()
        return len(response.event.delta.token_ids) <= self.max_buffered_tokens

    def put_final(self, request_id: str, response: gspb.GenerateResponse) -> None:
        """Queue the final event (finished or error) of ``request_id``; never refused."""
        self._open_delta.pop(request_id, None)
        self._queue.append(response)
        self._ready.set()

    def put_replay(self, request_id: str, response: gspb.GenerateResponse) -> None:
        """Queue a replayed event (a resume): never merged, never refused; live deltas that
        follow start a new entry."""
        self.put_final(request_id, response)

    def close(self) -> None:
        """No more events will come: ``get`` returns None once the queue is empty."""
        self._closed = True
        self._ready.set()

    @property
    def closed(self) -> bool:
        return self._closed

    async def get(self) -> gspb.GenerateResponse | None:
        """The next event to send, waiting for one; None once closed and empty."""
        while not self._queue:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        response = self._queue.popleft()
        rid = response.event.request_id
        if self._open_delta.get(rid) is response:  # being sent: later deltas start a new entry
            del self._open_delta[rid]
        return response
