"""Retries of requests the server turned away before they produced anything.

A request that got RESOURCE_EXHAUSTED (the server is at capacity) or UNAVAILABLE (no worker
could take it right now) before its first token is safe to send again: nothing of it reached
the caller. Once a token arrived it never is (the caller would see tokens twice). Delays
grow exponentially with jitter and never undercut the server's own hint (trailing metadata
``grpc-retry-pushback-ms`` or ``retry-after-ms``; on a multiplexed stream
``RequestError.retry_after_ms``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from draftwise_client._types import GenerationError

PUSHBACK_KEY = "grpc-retry-pushback-ms"
"""gRPC's standard retry hint (trailing metadata, milliseconds; negative: do not retry)."""
RETRY_AFTER_KEY = "retry-after-ms"
"""draftwise's own retry hint (trailing metadata, milliseconds)."""

RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
"""Codes worth retrying before the first token: the server did not run the request."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries a request refused before its first token. ``RetryPolicy.off()``
    (or ``retry=None`` on a client) turns retries off."""

    max_attempts: int = 5
    """Attempts in all, the first included (1: no retries)."""
    initial_backoff_s: float = 0.1
    """Delay before the first retry, when the server sent no hint."""
    max_backoff_s: float = 5.0
    """Upper bound of the exponential delay (a server's hint may ask for longer)."""
    multiplier: float = 2.0
    """Growth of the delay from one retry to the next."""
    jitter: float = 0.2
    """Each delay is stretched by a random factor in [1, 1 + jitter], so that clients refused
    together do not all come back at the same instant."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1 or self.jitter < 0:
            raise ValueError("need multiplier >= 1 and jitter >= 0")

    @classmethod
    def off(cls) -> RetryPolicy:
        """No retries: every refusal raises at once."""
        return cls(max_attempts=1)

    def delay_s(self, retry: int, hint_ms: int | None, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first), given the server's
        hint (None: none)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        if hint_ms is not None:
            base = max(base, hint_ms / 1000)
        return base * (1 + self.jitter * (rng or random).random())

    def should_retry(self, code: grpc.StatusCode, attempt: int, hint_ms: int | None, got_tokens: bool) -> bool:
        """Whether attempt number ``attempt`` (1-based), refused with ``code``, is retried."""
        if got_tokens or code not in RETRYABLE or attempt >= self.max_attempts:
            return False
        return hint_ms is None or hint_ms >= 0  # a negative pushback means "do not retry"


DEFAULT_RETRY = RetryPolicy()
"""The clients' default: up to 5 attempts, 0.1 s doubling to at most 5 s, 20 % jitter."""


def hint_from_metadata(metadata: object) -> int | None:
    """The retry hint (ms) of a call's trailing metadata; None when it has none."""
    found: dict[str, int] = {}
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key in (PUSHBACK_KEY, RETRY_AFTER_KEY):
            try:
                found[key] = int(value)
            except (TypeError, ValueError):
                continue
    return found.get(PUSHBACK_KEY, found.get(RETRY_AFTER_KEY))


def retry_delay(
    policy: RetryPolicy,
    error: GenerationError,
    attempt: int,
    received: bool,
    deadline: float | None = None,
    *,
    now: float | None = None,
    rng: random.Random | None = None,
) -> float | None:
    """Seconds to wait before sending the request again after ``error`` ended attempt
    ``attempt``; None when it must not be retried (tokens were received, the code is not
    retryable, attempts are used up, or the wait would pass ``deadline``, a monotonic time;
    ``now``: the current monotonic time, read from the clock when None)."""
    hint = error.retry_after_ms
    if not policy.should_retry(error.code, attempt, hint, received):
        return None
    delay = policy.delay_s(attempt, hint, rng)
    if deadline is not None and (time.monotonic() if now is None else now) + delay >= deadline:
        return None
    return delay
