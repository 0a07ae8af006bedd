"""A request's first delta carries its prompt token count and queue time
(``TokenDelta.prompt_tokens``/``queue_ms``) where the engine's RequestDelta provides them
(``num_prompt_tokens``, ``queue_time``); later deltas never do."""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.worker.outputs import RequestDelta
from draftwise.worker.proto_convert import responses_from_delta


@dataclass(frozen=True)
class _FirstDelta(RequestDelta):
    """A RequestDelta as an engine that reports the two figures makes it."""

    num_prompt_tokens: int | None = None
    queue_time: float | None = None


def _delta(first: int, cls: type[RequestDelta] = RequestDelta, **extra: object) -> RequestDelta:
    return cls(request_id="r", token_ids=[7], first_token_index=first, text="x", logprobs=None, finished=False, **extra)


def test_first_delta_carries_prompt_tokens_and_queue_time():
    (resp,) = responses_from_delta(_delta(0, _FirstDelta, num_prompt_tokens=37, queue_time=0.25))
    assert resp.event.delta.prompt_tokens == 37 and resp.event.delta.queue_ms == 250.0


def test_later_deltas_and_engines_without_the_fields_leave_them_zero():
    (later,) = responses_from_delta(_delta(5, _FirstDelta, num_prompt_tokens=37, queue_time=0.25))
    assert later.event.delta.prompt_tokens == 0 and later.event.delta.queue_ms == 0
    (plain,) = responses_from_delta(_delta(0))
    assert plain.event.delta.prompt_tokens == 0 and plain.event.delta.queue_ms == 0
