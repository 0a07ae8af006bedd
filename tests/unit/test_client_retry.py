"""The client's retry decisions: which refusals are retried, how long it waits (exponential,
capped, jittered, never shorter than the server's hint), and how it reads the hint."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
from draftwise_client import GenerationError, RetryPolicy  # noqa: E402
from draftwise_client._proto import generation_pb2 as cpb  # noqa: E402
from draftwise_client._retry import hint_from_metadata, retry_delay  # noqa: E402

S = grpc.StatusCode


def test_which_refusals_are_retried():
    p = RetryPolicy(max_attempts=3)
    assert p.should_retry(S.RESOURCE_EXHAUSTED, 1, None, got_tokens=False)
    assert p.should_retry(S.UNAVAILABLE, 2, 100, got_tokens=False)
    assert not p.should_retry(S.UNAVAILABLE, 1, None, got_tokens=True)  # never after a token
    assert not p.should_retry(S.RESOURCE_EXHAUSTED, 3, None, got_tokens=False)  # attempts used up
    assert not p.should_retry(S.RESOURCE_EXHAUSTED, 1, -1, got_tokens=False)  # negative pushback: don't
    for code in (S.INVALID_ARGUMENT, S.DEADLINE_EXCEEDED, S.INTERNAL, S.CANCELLED, S.UNAUTHENTICATED):
        assert not p.should_retry(code, 1, None, got_tokens=False)
    assert not RetryPolicy.off().should_retry(S.RESOURCE_EXHAUSTED, 1, None, got_tokens=False)


def test_delays():
    p = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.2)
    rng = random.Random(0)
    for retry, base in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)):
        for _ in range(50):
            assert base <= p.delay_s(retry, None, rng) <= base * 1.2
    assert 2.5 <= p.delay_s(1, 2500, rng) <= 3.0  # the server's hint wins, even past max_backoff_s
    assert 0.4 <= p.delay_s(3, 10, rng) <= 0.48  # a hint shorter than the backoff does not shorten it
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_retry_delay_respects_the_deadline():
    p = RetryPolicy(initial_backoff_s=0.5, jitter=0)
    err = GenerationError(S.RESOURCE_EXHAUSTED, "busy", retry_after_ms=None)
    assert retry_delay(p, err, 1, False) == 0.5
    assert retry_delay(p, err, 1, False, deadline=time.monotonic() + 0.1) is None


def test_hints():
    assert hint_from_metadata((("grpc-retry-pushback-ms", "250"), ("retry-after-ms", "999"))) == 250
    assert hint_from_metadata((("retry-after-ms", "999"),)) == 999
    assert hint_from_metadata((("grpc-retry-pushback-ms", "soon"),)) is None
    assert hint_from_metadata(None) is None
    err = cpb.RequestError(code=8, message="at capacity; retry after 50 ms", retry_after_ms=321)
    assert GenerationError.from_event("r", err).retry_after_ms == 321
    err = cpb.RequestError(code=8, message="at capacity; retry after 50 ms")
    assert GenerationError.from_event("r", err).retry_after_ms == 50
