"""One request's trip through the gateway: pick a worker, call its ``Generate``, hand every
event to the client stream's :class:`Outbox` (never waiting on the client), and end with
exactly one final event (finished or error) whatever happens.

A worker that turns out to be unreachable before the request produced anything is taken
out of rotation and the request retried on another. Once tokens reached the client, a worker
that dies, hangs (no progress for ``failover_stall_s``) or drains makes the request fail
over: it is resubmitted elsewhere with the tokens sent so far as its continuation, the same
sampling parameters and the remaining deadline, and relaying goes on at the next index (see docs/serving.md).

Every request also gets a resume handle on its first delta and a replay buffer
(:mod:`draftwise.gateway.replay`): when its client goes away it keeps running for
``resume_retention_s`` so that a ``ResumeGeneration`` can pick it up.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from draftwise.gateway.admission import Admission
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.replay import ReplayBudget, ReplayBuffer, ResumeError, new_handle
from draftwise.gateway.router import Router, WorkerHandle
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb

log = structlog.get_logger("draftwise.gateway.relay")

_FINISH_STATUS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Core:
    """What every request of one gateway shares."""

    config: GatewayConfig
    router: Router
    admission: Admission
    metrics: GatewayMetrics
    id_prefix: str
    draining: bool = False
    relays: set[Relay] = field(default_factory=set)
    streams: set[Any] = field(default_factory=set)  # open MultiplexedStreams
    resumable: dict[str, Relay] = field(default_factory=dict)  # resume handle -> request
    replay_budget: ReplayBudget = field(init=False)
    _ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.replay_budget = ReplayBudget(self.config.resume_buffer_total_bytes)
        # read when scraped: no gauge update (a lock and a store) per relayed delta
        budget = self.replay_budget
        self.metrics.replay_bytes.set_function(lambda: budget.used)
        self.router.watchers.append(self.watch)

    def watch(self) -> None:
        """After each round of polls: move requests off workers that drain, and off calls that
        sent tokens and then nothing for ``failover_stall_s`` (the worker is then kept out of
        rotation as long)."""
        now = time.monotonic()
        stall = self.config.failover_stall_s
        for relay in list(self.relays):
            w = relay.call_worker
            if w is None or relay.moving:
                continue
            if w.load.draining and self.router.pick(relay.model, frozenset({w})) is not None:
                # (with nowhere to go, the request finishes on the draining worker, as Drain promises)
                relay.move("drain", f"worker {w.address} is draining ({relay.num_tokens} output tokens sent)")
            elif relay.num_tokens and now - relay.t_progress > stall:
                reason = f"no progress for {stall:g}s"
                self.router.report_stall(w, stall, f"a request made {reason} on it (hung?)")
                relay.move("stall", f"worker {w.address} made {reason} after {relay.num_tokens} output tokens")

    def worker_request_id(self) -> str:
        """A request id unique across this gateway's requests (client ids are unique per stream only)."""
        return f"{self.id_prefix}-{next(self._ids)}"

    def default_model(self) -> str | None:
        if self.config.default_model:
            return self.config.default_model
        return next((w.model for w in self.router.workers if w.model), None)


CLIP_CHARS = 64
"""Client-supplied strings quoted in an error message are cut to this many characters."""
MAX_DETAILS_CHARS = 1024
"""A worker's error message is passed on cut to this length (it may quote the client's input)."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, "..." marking the cut: client input quoted in an
    error message must never make it unbounded (gRPC sends the message as metadata, which
    has its own, much smaller, limit)."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def _being_cancelled() -> bool:
    """Whether the running task itself is being cancelled (not merely a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class RequestError(Exception):
    """A request ends with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def resume_relay(core: Core, relay: Relay | None, outbox: Outbox, request_id: str, next_token_index: int) -> None:
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
        code = grpc.StatusCode.NOT_FOUND if e.code == "not_found" else grpc.StatusCode.INVALID_ARGUMENT
        raise RequestError(code, e.message) from None
    resumes.labels("ok").inc()


def error_response(
    request_id: str, code: grpc.StatusCode, message: str, retry_after_ms: int = 0
) -> gspb.GenerateResponse:
    error = pb.RequestError(code=code.value[0], message=message, retry_after_ms=retry_after_ms)
    return gspb.GenerateResponse(event=pb.GenerationEvent(request_id=request_id, error=error))


class Relay:
    """Runs one admitted request (its admission slot is released when it ends)."""

    def __init__(
        self,
        core: Core,
        request_id: str,
        start: pb.StartGeneration,
        model: str,
        outbox: Outbox | None,
        timeout_s: float | None,
    ) -> None:
        self.core = core
        self.request_id = request_id
        self.model = model
        self.outbox = outbox
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.start_request_id = request_id  # what a resume with an empty request_id uses
        self.request = wpb.WorkerServiceGenerateRequest(start=start)
        self.base_id = core.worker_request_id()
        self.request.start.request_id = self.base_id
        self.request.start.model = model
        # No seed is invented for unseeded requests: they continue from the model's distribution
        # after a failover, and keep exact rejection sampling (the higher acceptance) under
        # speculation; seeded ones continue token for token (randomness keyed by seed and position).
        self.t0 = time.perf_counter()
        self.t_last = 0.0
        # every output token the client has, in order: a client may itself start from a continuation
        self.tokens: list[int] = list(start.continuation.output_token_ids)
        self.spec: pb.SpeculationStats | None = None  # the latest cumulative speculation counters
        self.failovers = 0
        # the worker call in progress (None between attempts), and a move asked of it
        self.call_worker: WorkerHandle | None = None
        self._call_obj: grpc.aio.UnaryStreamCall | None = None
        self._move: tuple[str, str] | None = None
        self.t_progress = 0.0  # monotonic time of the current call's start or last event
        # resumption
        self.handle = ""
        self.buffer: ReplayBuffer | None = None
        if core.config.resume_retention_s > 0:
            self.buffer = ReplayBuffer(core.replay_budget, core.config.resume_buffer_bytes, num_tokens=len(self.tokens))
        self._expiry: asyncio.TimerHandle | None = None
        self.on_takeover: Callable[[], None] | None = None
        """Called when a resume on another stream takes this request over (its stream forgets it)."""
        # the prompt's size and the worker's queue time, for the ABORT event the gateway builds
        # itself: known up front for token ids, else from the worker's first delta
        self.prompt_tokens = len(start.prompt.token_ids.ids)
        self.queue_ms = 0.0
        self.t_first = 0.0
        self.worker: WorkerHandle | None = None
        self.final_status: str | None = None
        self._cancel: tuple[grpc.StatusCode, str] | None = None
        self._task: asyncio.Task[None] | None = None
        self.log = log.bind(request_id=request_id, worker_request_id=self.request.start.request_id)

    # ------------------------------------------------------------------ lifecycle

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def start(self) -> asyncio.Task[None]:
        self.core.relays.add(self)
        self.core.metrics.in_flight.inc()
        self._task = asyncio.create_task(self._run(), name=f"relay-{self.request_id}")
        return self._task

    @property
    def done(self) -> bool:
        return self.final_status is not None

    @property
    def num_tokens(self) -> int:
        """Output tokens sent to the client so far."""
        return len(self.tokens)

    @property
    def moving(self) -> bool:
        return self._move is not None

    def move(self, reason: str, detail: str) -> None:
        """Fail over now (``reason``: drain or stall): the worker call is cancelled (freeing the
        request's KV there) and the request resubmitted elsewhere."""
        if self._move is not None or self._call_obj is None or self.done:
            return
        self._move = (reason, detail)
        self._call_obj.cancel()

    def cancel(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, message: str = "") -> None:
        """End the request now: CANCELLED sends a finished ABORT event, another code an error
        event. The worker call is cancelled, which frees the request's KV blocks."""
        if self._task is None or self._task.done() or self._cancel is not None or self.final_status is not None:
            return
        self._cancel = (code, message)
        self._task.cancel()

    # ------------------------------------------------------------------ resumption

    def client_gone(self, outbox: Outbox) -> None:
        """The client stream behind ``outbox`` went away. A resumable request keeps running,
        its events kept for a resume, for ``resume_retention_s``; any other is cancelled."""
        if self.outbox is not outbox or self.done or self._cancel is not None:
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

    def _expire(self) -> None:
        """Retention passed without a resume: cancel the request (its KV is freed), forget it."""
        self._expiry = None
        self.core.metrics.detached.dec()
        self.log.info("resume retention passed; request dropped", running=not self.done)
        self.cancel()
        self._unregister("its retention time passed")

    def resume(self, outbox: Outbox, request_id: str, next_token_index: int) -> None:
        """Send the events from ``next_token_index`` on into ``outbox`` as ``request_id``, then
        the live rest. ResumeError when that index is not a boundary or beyond what was produced."""
        assert self.buffer is not None  # only buffered requests are registered
        events = self.buffer.replay(next_token_index, request_id)
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
        if self.done:
            self._unregister("it finished and its events were delivered")

    def _unregister(self, why: str) -> None:
        if self.handle and self.core.resumable.get(self.handle) is self:
            del self.core.resumable[self.handle]
        if self.buffer is not None:
            self.buffer.drop(why)

    async def _run(self) -> None:
        try:
            await self._attempts()
        except asyncio.CancelledError:
            if self._cancel is None:  # the client stream went away: nobody to tell
                self._final_status("cancelled")
                raise
            code, message = self._cancel
            if code == grpc.StatusCode.CANCELLED:
                self._emit_finished_abort()
            else:
                self._emit_error(code, message)
        except RequestError as e:
            self._emit_error(e.code, e.message)
        except Exception as e:  # a bug: still end the request, visibly
            self.log.exception("relay failed")
            self._emit_error(grpc.StatusCode.INTERNAL, f"gateway error: {e!r}")
        finally:
            self._final_status("cancelled")  # no-op when already set
            if self._expiry is None:  # else kept for a resume until it expires
                self._unregister("it finished")
            self.core.admission.release()
            self.core.relays.discard(self)
            self.core.metrics.in_flight.dec()
            self.core.metrics.e2e_latency.observe(time.perf_counter() - self.t0)
            self.log.info(
                "request finished",
                status=self.final_status,
                output_tokens=self.num_tokens,
                failovers=self.failovers,
                worker=self.worker.address if self.worker else None,
                ms=round((time.perf_counter() - self.t0) * 1000, 1),
            )

    async def _attempts(self) -> None:
        # worker -> its channel when it failed this request: a worker restarted since (a new
        # channel) may take the request again
        excluded: dict[WorkerHandle, Any] = {}
        last_failure = ""
        while True:
            w = self._pick(excluded)
            if w is None:
                if not self.num_tokens:  # nothing sent yet: the client may simply retry
                    raise RequestError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"no healthy worker serves model {self.model!r} ({self.core.router.describe()}); retry shortly",
                    )
                w = await self._wait_for_worker(excluded, last_failure)
            excluded[w] = w.channel
            self.worker = w
            w.in_flight += 1
            try:
                failed = await self._call(w)
            finally:
                w.in_flight -= 1
            if failed is None:
                return
            last_failure = failed[1]
            if self.num_tokens:
                self._prepare_failover(w, *failed)

    def _pick(self, excluded: dict[WorkerHandle, Any]) -> WorkerHandle | None:
        out = frozenset(w for w, channel in excluded.items() if w.channel is channel)
        return self.core.router.pick(self.model, out)

    async def _wait_for_worker(self, excluded: dict[WorkerHandle, Any], why: str) -> WorkerHandle:
        """A healthy worker to fail over to, waiting up to ``failover_wait_s`` (within the
        deadline) for one to come (back) up."""
        t0 = time.monotonic()
        until = t0 + self.core.config.failover_wait_s
        if self.deadline is not None:
            until = min(until, self.deadline)
        while time.monotonic() < until:
            await asyncio.sleep(0.05)
            w = self._pick(excluded)
            if w is not None:
                return w
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"{why}, and no healthy worker came up to continue on within {time.monotonic() - t0:.1f}s "
            f"({self.core.router.describe()}); {self.num_tokens} output tokens were delivered: "
            "retry it (or resubmit the prompt plus those tokens)",
        )

    def _prepare_failover(self, w: WorkerHandle, reason: str, detail: str) -> None:
        """Resubmit the request with what the client has as its continuation, or end it
        UNAVAILABLE once it has failed over ``max_failovers`` times."""
        cfg = self.core.config
        if self.failovers >= cfg.max_failovers:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"{detail}; {self.num_tokens} output tokens were delivered and the request had already moved "
                f"{self.failovers} times (--max-failovers={cfg.max_failovers}): retry it",
            )
        self.failovers += 1
        start = self.request.start
        start.request_id = f"{self.base_id}.{self.failovers}"
        cont = start.continuation
        del cont.output_token_ids[:]
        cont.output_token_ids.extend(self.tokens)
        if self.spec is not None:
            cont.speculation.CopyFrom(self.spec)
        recomputed = self.prompt_tokens + self.num_tokens
        m = self.core.metrics
        m.failovers.labels(reason).inc()
        m.failover_recomputed_tokens.inc(recomputed)
        self.log.warning(
            "failing over", worker=w.address, reason=reason, detail=detail, tokens=self.num_tokens, n=self.failovers
        )

    # ------------------------------------------------------------------ one worker call

    async def _call(self, w: WorkerHandle) -> tuple[str, str] | None:
        """Run the request on ``w``; (reason, detail) when it should go on on another worker."""
        timeout = None
        if self.deadline is not None:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request started")
        self._move = None
        call = w.generate(self.request, timeout=timeout)
        self._call_obj, self.call_worker, self.t_progress = call, w, time.monotonic()
        try:
            # (``async for``, not ``read()``: read() answers EOF as soon as the call has its status,
            # dropping events still buffered, such as the final one)
            async for resp in call:
                self.t_progress = time.monotonic()
                event = resp.event
                kind = event.WhichOneof("kind")
                if kind == "delta":
                    self._relay_delta(w, resp)
                elif kind == "finished":
                    if self.failovers:
                        self._fix_timings(event.finished.timings)
                    self.core.metrics.observe_finished(event.finished)
                    self._final_status(_FINISH_STATUS.get(event.finished.finish_reason, "stop"))
                    self._put_final(resp)
                    return None
                else:  # the worker sends errors as the call status, but pass one on if it comes
                    self._final_status(grpc.StatusCode.UNKNOWN.name.lower())
                    self._put_final(resp)
                    return None
        except grpc.aio.AioRpcError as e:
            return self._on_worker_error(w, e)
        except asyncio.CancelledError:
            if self._move is not None and not _being_cancelled():
                return self._move  # move() cancelled the call: go on elsewhere
            raise
        finally:
            self._call_obj = self.call_worker = None
            if not call.done():
                call.cancel()  # the worker aborts the request and frees its blocks
        if self._move is not None:
            return self._move
        if self.num_tokens:
            return (
                "unavailable",
                f"worker {w.address} ended the request without a final event after {self.num_tokens} output tokens",
            )
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE, f"worker {w.address} ended the request without a final event; retry it"
        )

    def _relay_delta(self, w: WorkerHandle, resp: gspb.GenerateResponse) -> None:
        """Pass one worker delta on: tokens the client already has are dropped (a failover
        goes on at the next index), the first one carries the resume handle."""
        d = resp.event.delta
        sent = self.num_tokens
        if d.first_token_index != sent:
            if d.first_token_index > sent:
                raise RequestError(
                    grpc.StatusCode.INTERNAL,
                    f"worker {w.address} sent tokens from index {d.first_token_index}, but {sent} were sent so far",
                )
            skip = sent - d.first_token_index
            if skip >= len(d.token_ids):
                return  # all duplicates
            del d.token_ids[:skip]
            if len(d.logprobs):
                del d.logprobs[:skip]
            d.first_token_index = sent
        if d.HasField("speculation"):
            self.spec = pb.SpeculationStats()
            self.spec.CopyFrom(d.speculation)
        self._observe_delta(d)
        if not self.handle and self.buffer is not None:
            self.handle = new_handle()
            d.resume_handle = self.handle
            self.core.resumable[self.handle] = self
        self._put_delta(resp)

    def _put_delta(self, resp: gspb.GenerateResponse) -> None:
        rid = self.request_id
        resp.event.request_id = rid
        if self.buffer is not None and self.buffer.lost is None:
            self.buffer.add_delta(resp)
            if self.buffer.lost is not None:
                self.log.warning("request no longer resumable", why=self.buffer.lost)
        outbox = self.outbox
        if outbox is not None and not outbox.put_delta(rid, resp):
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the client is not reading this stream fast enough: more than "
                f"{outbox.max_buffered_tokens} tokens of this request were waiting to be sent; "
                "read the stream faster (or open more streams) and retry",
            )

    def _put_final(self, resp: gspb.GenerateResponse) -> None:
        rid = self.request_id
        resp.event.request_id = rid
        if self.outbox is not None:
            self.outbox.put_final(rid, resp)
        elif self.buffer is not None:  # nobody attached: kept for a resume
            self.buffer.set_final(resp)

    def _fix_timings(self, t: pb.Timings) -> None:
        """After a failover the worker's timings start at its own arrival: report the whole
        request's instead (queue time as the first worker saw it; the rest on the gateway's clock)."""
        t.queue_ms = self.queue_ms
        t.time_to_first_token_ms = (self.t_first - self.t0) * 1000 if self.t_first else 0.0
        t.total_ms = (time.perf_counter() - self.t0) * 1000

    def _on_worker_error(self, w: WorkerHandle, e: grpc.aio.AioRpcError) -> tuple[str, str] | None:
        code, details = e.code(), clip(e.details() or "", MAX_DETAILS_CHARS)
        S = grpc.StatusCode
        if code in (S.INTERNAL, S.UNAVAILABLE):
            self.core.metrics.engine_errors.labels(w.name).inc()
        if code == S.UNAVAILABLE:
            self.core.router.report_failure(w, f"Generate failed: {details}")
            if self.num_tokens == 0:
                self.log.warning("worker unavailable, retrying elsewhere", worker=w.address, details=details)
            return (
                "unavailable",
                f"worker {w.address} became unavailable after {self.num_tokens} output tokens ({details})",
            )
        if code == S.CANCELLED:
            if self.num_tokens:  # the worker stopped it (shutting down): go on elsewhere
                return (
                    "unavailable",
                    f"worker {w.address} stopped the request after {self.num_tokens} output tokens ({details})",
                )
            raise RequestError(S.UNAVAILABLE, f"worker {w.address} stopped the request ({details}); retry it")
        if code == S.NOT_FOUND:
            raise RequestError(S.INVALID_ARGUMENT, details)
        if code == S.DEADLINE_EXCEEDED:
            raise RequestError(S.DEADLINE_EXCEEDED, f"deadline exceeded after {self.num_tokens} output tokens")
        raise RequestError(code, details or f"worker {w.address} failed the request ({code.name})")

    # ------------------------------------------------------------------ events and metrics

    def _observe_delta(self, delta: pb.TokenDelta) -> None:
        n = len(delta.token_ids)
        if not n:
            return
        now = time.perf_counter()
        m = self.core.metrics
        if not self.t_first:
            self.t_first = now
            if delta.prompt_tokens:
                self.prompt_tokens = delta.prompt_tokens
            self.queue_ms = delta.queue_ms
            m.time_to_first_token.observe(now - self.t0)
        else:
            gap = (now - self.t_last) / n
            for _ in range(n):
                m.inter_token_latency.observe(gap)
        self.t_last = now
        self.tokens.extend(delta.token_ids)
        m.generation_tokens.inc(n)

    def _final_status(self, status: str) -> None:
        if self.final_status is None:
            self.final_status = status
            self.core.metrics.requests.labels(status).inc()

    def _emit_error(self, code: grpc.StatusCode, message: str) -> None:
        self._final_status(code.name.lower())
        if code != grpc.StatusCode.INVALID_ARGUMENT:
            self.log.warning("request failed", code=code.name, message=message)
        self._put_final(error_response(self.request_id, code, message))

    def _emit_finished_abort(self) -> None:
        """The final ABORT of a request the gateway ended: the usage and timings known so far
        (prompt tokens and queue time as the worker reported them; time to first token and
        total time on the gateway's clock, from the request's arrival there)."""
        self._final_status("abort")
        finished = pb.Finished(
            finish_reason=pb.FINISH_REASON_ABORT,
            usage=pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.num_tokens),
        )
        t = finished.timings
        t.queue_ms = self.queue_ms
        if self.t_first:
            t.time_to_first_token_ms = (self.t_first - self.t0) * 1000
        t.total_ms = (time.perf_counter() - self.t0) * 1000
        self.core.metrics.observe_finished(finished)
        self._put_final(gspb.GenerateResponse(event=pb.GenerationEvent(request_id=self.request_id, finished=finished)))
