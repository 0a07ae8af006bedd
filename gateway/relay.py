"""One request's trip through the gateway: pick a worker, call its ``Generate``, hand every
event to the client stream's :class:`Outbox` (never waiting on the client), and end with
exactly one final event (finished or error) whatever happens.

A worker that turns out to be unreachable before the request produced anything is taken
out of rotation and the request retried on another, and so is one that hangs (answers no
load poll for ``failover_stall_s``) before the first token. Once tokens reached the client, a
worker that dies, hangs or drains makes the request fail over
(:mod:`draftwise.gateway.failover`): it is resubmitted elsewhere with the tokens sent so far as
its continuation, the same sampling parameters and the remaining deadline, and relaying goes
on at the next index (see docs/serving.md).

Every request also gets a resume handle on its first delta and a replay buffer
(:mod:`draftwise.gateway.resumption`): when its client goes away it is *paused* for
``resume_retention_s`` (:meth:`Relay.pause`): its admission slot is given back and its worker
call cancelled (the worker frees its KV), its tokens kept; a ``ResumeGeneration`` re-admits it
and it goes on as a continuation on any worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import structlog

from draftwise.gateway.admit import Admitted
from draftwise.gateway.core import Core
from draftwise.gateway.errors import MAX_DETAILS_CHARS, RequestError, clip, error_response
from draftwise.gateway.failover import as_continuation, finished_by, pick, prepare_failover, wait_for_worker
from draftwise.gateway.prefix_routing import route_key
from draftwise.gateway.replay import new_handle
from draftwise.gateway.resumption import Resumable
from draftwise.gateway.router import WorkerHandle
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb

log = structlog.get_logger("draftwise.gateway.relay")

PAUSE = "pause"
"""The reason ``_call`` returns when :meth:`Relay.pause` stopped the worker call."""
_FINISH_STATUS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def _being_cancelled() -> bool:
    """Whether the running task itself is being cancelled (not merely a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Relay(Resumable):
    """Runs one admitted request (its admission slot is released when it ends or pauses)."""

    def __init__(
        self,
        core: Core,
        request_id: str,
        start: pb.StartGeneration,
        admitted: Admitted,
        outbox: Outbox | None,
        timeout_s: float | None,
        cache_salt: str = "",
        stream_interval: int | None = None,
    ) -> None:
        # every output token the client has, in order: a client may itself start from a continuation
        self.tokens: list[int] = list(start.continuation.output_token_ids)
        super().__init__(core, request_id, outbox, num_tokens=len(self.tokens))
        self.model = model = admitted.model
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # the salt stays with the request, failovers and resumes included (docs/serving.md)
        self.request = wpb.WorkerServiceGenerateRequest(start=start, cache_salt=cache_salt)
        # tokens per worker delta after the first (docs/serving.md, "Answers read whole"); None: --stream-interval
        self.request.stream_interval = core.config.stream_interval if stream_interval is None else stream_interval
        self.route_key = route_key(core.config, cache_salt, model, start.prompt)
        self.base_id = core.worker_request_id()
        self.request.start.request_id = self.base_id
        self.request.start.model = model
        # No seed is invented for unseeded requests: they continue from the model's distribution
        # after a failover, and keep exact rejection sampling (the higher acceptance) under
        # speculation; seeded ones continue token for token (randomness keyed by seed and position).
        self.t0 = time.perf_counter()
        self.t_last = 0.0
        self.spec: pb.SpeculationStats | None = None  # the latest cumulative speculation counters
        self.failovers = 0
        self.worker_deltas = 0  # delta messages received from workers (logged: streamed, about one a token)
        self.fruitless_moves = 0  # moves in a row with no token from the worker moved to
        self.tokens_at_move = 0
        self.resubmits = 0  # continuations sent (failovers and resumes after a pause)
        self._holding = False  # holds its admission slot, counts in core.relays and the in-flight gauge
        # the worker call in progress (None between attempts), and a move asked of it
        self.call_worker: WorkerHandle | None = None
        self._call_obj: grpc.aio.UnaryStreamCall | None = None
        self._move: tuple[str, str] | None = None
        self.t_progress = 0.0  # monotonic time of the current call's start or last event
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
        self._hold(True)  # the slot of its admission ticket
        self._task = asyncio.create_task(self._run(), name=f"relay-{self.request_id}")
        return self._task

    def _hold(self, on: bool) -> None:
        """Take (``on``: its slot already acquired) or give back what a running request holds:
        its admission slot, its place among the requests in flight (watched for failover,
        waited for at shutdown) and its count in the in-flight gauge."""
        if on == self._holding:
            return
        self._holding = on
        core = self.core
        if on:
            core.relays.add(self)
            core.metrics.in_flight.inc()
        else:
            core.admission.release()
            core.relays.discard(self)
            core.metrics.in_flight.dec()

    def _stop_call(self) -> None:
        """Cancel the worker call in progress for a pause (the worker aborts the request and
        frees its KV blocks); none between calls, where the attempt loop checks ``paused``."""
        if self._call_obj is not None and self._move is None:
            self._move = (PAUSE, "its client went away")
            self._call_obj.cancel()

    @property
    def done(self) -> bool:
        return self.final_status is not None

    @property
    def num_tokens(self) -> int:
        """Output tokens sent to the client so far."""
        return len(self.tokens)

    @property
    def cancelling(self) -> bool:
        return self._cancel is not None

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

    async def _run(self) -> None:
        try:
            await self._attempts()
        except asyncio.CancelledError:
            if self._cancel is None:  # the client stream went away: nobody to tell
                self._final_status("cancelled")
                raise
            code, message = self._cancel
            if code == grpc.StatusCode.CANCELLED:
                # (a constrained request still running was not complete: a complete one finishes by itself)
                self._emit_finished(
                    pb.Finished(finish_reason=pb.FINISH_REASON_ABORT, constraint_unfinished=self._constrained)
                )
            else:
                self._emit_error(code, message)
        except RequestError as e:
            self._emit_error(e.code, e.message)
        except Exception as e:  # a bug: still end the request, visibly
            self.log.exception("relay failed")
            self._emit_error(grpc.StatusCode.INTERNAL, f"gateway error: {e!r}")
        finally:
            self._final_status("cancelled")  # no-op when already set
            if not self.detached:  # else kept for a resume until it expires
                self._unregister("it finished")
            self._hold(False)
            self.core.metrics.e2e_latency.observe(time.perf_counter() - self.t0)
            self.log.info(
                "request finished",
                status=self.final_status,
                output_tokens=self.num_tokens,
                worker_deltas=self.worker_deltas,
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
            if self._paused:  # no worker call until a resume
                await self._go_on()
            w = pick(self, excluded)
            if w is None:
                if not self.num_tokens:  # nothing sent yet: the client may simply retry
                    raise RequestError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"no healthy worker serves model {self.model!r} ({self.core.router.describe()}); retry shortly",
                    )
                w = await wait_for_worker(self, excluded, last_failure)
                if self._paused:  # (its client went away meanwhile)
                    continue
            excluded[w] = w.channel
            self.worker = w
            w.in_flight += 1
            try:
                failed = await self._call(w)
            finally:
                w.in_flight -= 1
            if failed is None:
                return
            if failed[0] == PAUSE:  # not the worker's fault: it may take the request again
                del excluded[w]
                await self._go_on()
                continue
            last_failure = failed[1]
            if self.num_tokens:
                prepare_failover(self, w, *failed)
            else:
                self.log.warning("retrying on another worker", worker=w.address, reason=failed[0], detail=failed[1])

    async def _go_on(self) -> None:
        """Wait for the resume of a paused request (at once when it came already), then go on
        from the tokens so far as a continuation, under a fresh worker request id."""
        await self._resumed.wait()
        as_continuation(self)
        self.log.info("going on after a pause", tokens=self.num_tokens, id=self.request.start.request_id)

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
                    self.worker_deltas += 1
                    self._relay_delta(w, resp)
                elif kind == "finished":
                    if self.resubmits:
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
        """After a failover or a pause the worker's timings start at its own arrival: report the whole
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
        if code == S.INVALID_ARGUMENT and self.resubmits:  # our continuation: the output may be whole
            finished = finished_by(e.trailing_metadata(), self._constrained)
            if finished is not None:  # (its worker died between the last token and the final event)
                self.log.info("finished: the continuation was the whole output", reason=details)
                self._emit_finished(finished)
                return None
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

    @property
    def _constrained(self) -> bool:
        return self.request.start.sampling_params.WhichOneof("constraint") is not None

    def _emit_finished(self, finished: pb.Finished) -> None:
        """The final event of a request the gateway ended (ABORT) or found finished (a continuation
        that was the whole output): ``finished``'s reason with the usage and timings known so far
        (prompt tokens and queue time as the worker reported them; time to first token and total
        time on the gateway's clock, from the request's arrival there)."""
        self._final_status(_FINISH_STATUS.get(finished.finish_reason, "stop"))
        finished.usage.CopyFrom(pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.num_tokens))
        t = finished.timings
        t.queue_ms = self.queue_ms
        if self.t_first:
            t.time_to_first_token_ms = (self.t_first - self.t0) * 1000
        t.total_ms = (time.perf_counter() - self.t0) * 1000
        self.core.metrics.observe_finished(finished)
        self._put_final(gspb.GenerateResponse(event=pb.GenerationEvent(request_id=self.request_id, finished=finished)))
