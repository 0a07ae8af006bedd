"""The one admission decision every front makes before it starts a request: the gateway is
not draining, the request passes the gateway's checks (its model, its prompt), and an
admission slot is free (:class:`~draftwise.gateway.admission.Admission`).

:func:`admit` answers with a typed result: :class:`Admitted` (the slot is taken; the
:class:`~draftwise.gateway.relay.Relay` built from it releases it when the request ends) or
:class:`Refused` (a status code and a message, counted in ``draftwise_requests_total``). Each
front puts a refusal in its own wire form: a call status (``GenerateStream``, with the retry
hint in trailing metadata), the request's final error event (the ``Generate`` stream), an
OpenAI JSON error (HTTP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import grpc

from draftwise.gateway.core import Core
from draftwise.gateway.errors import RequestError
from draftwise.gateway.validate import validate_start
from draftwise.v1 import generation_pb2 as pb

DRAINING_MESSAGE = "the server is shutting down; send it to another instance"
"""Why a request is refused while the gateway drains (UNAVAILABLE)."""


class Why(StrEnum):
    """Why a request was refused (for a front whose wire form words some cases itself)."""

    DRAINING = "draining"
    """The gateway is shutting down (UNAVAILABLE)."""
    INVALID = "invalid"
    """The request's checks failed (their code: INVALID_ARGUMENT, UNAVAILABLE, NOT_FOUND, ...)."""
    AT_CAPACITY = "at_capacity"
    """Every admission slot is taken (RESOURCE_EXHAUSTED, with a retry hint)."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """A ticket: the request may start on ``model``; it holds one admission slot."""

    model: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The request may not start: end it with ``code`` and ``message``."""

    code: grpc.StatusCode
    message: str
    why: Why
    retry_after_ms: int = 0
    """How long to wait before retrying (AT_CAPACITY only; 0: no hint)."""


Check = Callable[[Core, pb.StartGeneration], str]
"""The checks of a request that pick the model to run it on; RequestError when it cannot run."""


def admit(core: Core, start: pb.StartGeneration, check: Check = validate_start) -> Admitted | Refused:
    """Admit ``start``: not while draining, only past ``check`` (the gateway's own checks by
    default), and only with a free slot. A refusal is counted by its code."""
    if core.draining:
        refused = Refused(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE, Why.DRAINING)
    else:
        try:
            model = check(core, start)
        except RequestError as e:
            refused = Refused(e.code, e.message, Why.INVALID)
        else:
            admission = core.admission
            if admission.try_acquire():
                return Admitted(model)
            refused = Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, admission.rejection(), Why.AT_CAPACITY, admission.retry_after_ms
            )
    core.metrics.requests.labels(refused.code.name.lower()).inc()
    return refused
