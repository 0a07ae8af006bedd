"""Failover: when a request leaves its worker, and how it continues on another.

:func:`watch` runs after each round of load polls (the gateway registers it with the router)
and moves requests off workers that drain and off workers that hang. A hang is judged on the
worker, never on one request's silence: a worker hangs when it has answered no ``GetLoad``
poll for ``failover_stall_s`` (a stopped or wedged process). A worker busy with a long engine
step (a long prefill on a loaded machine) still answers its polls from its gRPC front, so
however long a step takes its requests stay where they are. Requests move only when another
healthy worker can take them: with nowhere to go they keep waiting on their call. A request
that has to go on elsewhere (its worker died, hung or drains) waits for a worker with
:func:`pick` / :func:`wait_for_worker`; one that had sent tokens is resubmitted by
:func:`prepare_failover` as a continuation (:func:`as_continuation`: the tokens its client
has, the same sampling parameters and the speculation counters so far, at the next index; see
docs/serving.md), one that had not is simply sent again. A paused request (its client gone,
kept for a resume) goes on the same way when it is resumed. A worker that dies after a request's
last token but before its final event leaves the gateway a whole output: the next worker refuses
that continuation and says how it ended (:func:`finished_by`), and the gateway finishes it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import grpc

from draftwise.gateway.core import Core
from draftwise.gateway.errors import RequestError
from draftwise.gateway.router import WorkerHandle
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.wire import FINISHED_REASON_KEY, FINISHED_STOP_STR_KEY, FINISHED_STOP_TOKEN_KEY


class Movable(Protocol):
    """What failover reads and writes of a request (a :class:`~draftwise.gateway.relay.Relay`)."""

    core: Core
    model: str
    deadline: float | None
    """Monotonic time by which it must end (None: no deadline)."""
    request: wpb.WorkerServiceGenerateRequest
    """What is sent to a worker; a failover rewrites its start as a continuation."""
    route_key: bytes | None
    """Its key for cache-aware routing (None: least-loaded routing)."""
    base_id: str
    """The worker request id of its first attempt (the n-th failover sends ``base_id.n``)."""
    tokens: list[int]
    """Every output token its client has, in order."""
    spec: pb.SpeculationStats | None
    failovers: int
    """Times it moved to another worker after it sent tokens."""
    fruitless_moves: int
    """Moves in a row after which its new worker sent no token (reset by a token)."""
    tokens_at_move: int
    """Output tokens it had when it last moved."""
    resubmits: int
    """Times it was sent again as a continuation (failovers and resumes after a pause)."""
    prompt_tokens: int
    log: Any

    @property
    def num_tokens(self) -> int: ...


def watch(core: Core) -> None:
    """After each round of polls: move requests off workers that drain, and off workers that
    answered no load poll for ``failover_stall_s`` (hung), in both cases only when another
    healthy worker can take them."""
    now = time.monotonic()
    stall = core.config.failover_stall_s
    router = core.router
    hung = {w: w.silent_s(now) for w in router.workers if w.silent_s(now) > stall}
    for relay in list(core.relays):
        w = relay.call_worker
        if w is None or relay.moving or not (w.load.draining or w in hung):
            continue
        if router.pick(relay.model, frozenset({w})) is None:
            continue  # nowhere to go: finish on the draining worker (as Drain promises), wait on the silent one
        if w in hung:
            relay.move(
                "stall",
                f"worker {w.address} answered no load poll for {hung[w]:.0f}s (--failover-stall-s={stall:g}: "
                f"hung?) after {relay.num_tokens} output tokens",
            )
        else:
            relay.move("drain", f"worker {w.address} is draining ({relay.num_tokens} output tokens sent)")


def pick(relay: Movable, excluded: dict[WorkerHandle, Any]) -> WorkerHandle | None:
    """A healthy worker for ``relay``'s model (the router's choice for its route key), leaving
    out the ``excluded`` workers (worker -> its channel when it failed this request) unless
    restarted since (a new channel)."""
    out = frozenset(w for w, channel in excluded.items() if w.channel is channel)
    return relay.core.router.pick(relay.model, out, relay.route_key)


async def wait_for_worker(relay: Movable, excluded: dict[WorkerHandle, Any], why: str) -> WorkerHandle:
    """A healthy worker to fail over to, waiting up to ``failover_wait_s`` (within the
    deadline) for one to come (back) up; RequestError UNAVAILABLE when none does."""
    core = relay.core
    t0 = time.monotonic()
    until = t0 + core.config.failover_wait_s
    if relay.deadline is not None:
        until = min(until, relay.deadline)
    while time.monotonic() < until:
        await asyncio.sleep(0.05)
        w = pick(relay, excluded)
        if w is not None:
            return w
    raise RequestError(
        grpc.StatusCode.UNAVAILABLE,
        f"{why}, and no healthy worker came up to continue on within {time.monotonic() - t0:.1f}s "
        f"({core.router.describe()}); {relay.num_tokens} output tokens were delivered: "
        "retry it (or resubmit the prompt plus those tokens)",
    )


def prepare_failover(relay: Movable, w: WorkerHandle, reason: str, detail: str) -> None:
    """Resubmit the request with what the client has as its continuation, or end it UNAVAILABLE
    once it has moved ``max_failovers`` times in a row without a token from the worker it moved
    to: a request that makes progress on each worker it lands on may move as often as workers
    fail (each move then delivered a token, so max_tokens bounds them)."""
    cfg = relay.core.config
    if relay.num_tokens > relay.tokens_at_move:  # the worker it leaves sent tokens: progress
        relay.fruitless_moves = 0
    if relay.fruitless_moves >= cfg.max_failovers:
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"{detail}; {relay.num_tokens} output tokens were delivered and the request had already moved "
            f"{relay.fruitless_moves} times in a row with no token from the worker it moved to "
            f"(--max-failovers={cfg.max_failovers}): retry it",
        )
    relay.fruitless_moves += 1
    relay.tokens_at_move = relay.num_tokens
    relay.failovers += 1
    as_continuation(relay)
    recomputed = relay.prompt_tokens + relay.num_tokens
    m = relay.core.metrics
    m.failovers.labels(reason).inc()
    m.failover_recomputed_tokens.inc(recomputed)
    relay.log.warning(
        "failing over",
        worker=w.address,
        reason=reason,
        detail=detail,
        tokens=relay.num_tokens,
        n=relay.failovers,
        fruitless=relay.fruitless_moves - 1,
    )


def as_continuation(relay: Movable) -> None:
    """Rewrite the request to go on from the tokens its client has (same prompt and sampling
    parameters, the speculation counters so far) under a fresh worker request id: ``base_id.n``
    for its n-th resubmission (the worker may not have dropped the previous id yet)."""
    relay.resubmits += 1
    start = relay.request.start
    start.request_id = f"{relay.base_id}.{relay.resubmits}"
    cont = start.continuation
    del cont.output_token_ids[:]
    cont.output_token_ids.extend(relay.tokens)
    if relay.spec is not None:
        cont.speculation.CopyFrom(relay.spec)


def finished_by(metadata: Any, constrained: bool) -> pb.Finished | None:
    """The final event of a request whose continuation a worker refused as a whole output, from the
    refusal's trailing ``metadata`` (draftwise.wire: "length" or "stop", the stop token id or string),
    its reason and stop only (the relay adds usage and timings); None when the refusal says no such
    thing. ``constrained``: the request has a constraint, unfinished unless it ended on EOS."""
    md: dict[str, Any] = {}
    for key, value in metadata or ():
        md.setdefault(key, value)
    reason = md.get(FINISHED_REASON_KEY)
    if reason == "length":
        return pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH, constraint_unfinished=constrained)
    if reason != "stop":
        return None
    finished = pb.Finished(finish_reason=pb.FINISH_REASON_STOP)
    if FINISHED_STOP_TOKEN_KEY in md:
        finished.stop_token_id = int(md[FINISHED_STOP_TOKEN_KEY])
    elif FINISHED_STOP_STR_KEY in md:
        value = md[FINISHED_STOP_STR_KEY]
        finished.stop_str = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    # a constrained output ends on EOS only once complete; a stop id or string may cut it first
    finished.constraint_unfinished = constrained and finished.WhichOneof("stop_reason") is not None
    return finished
