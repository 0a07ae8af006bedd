"""One request's trip through the gateway: pick a worker, call its ``Generate``, hand every
event to the client stream's :class:`Outbox` (never waiting on the client), and end with
exactly one final event (finished or error) whatever happens.

A worker that turns out to be unreachable before the request produced anything is taken
out of rotation and the request retried on another; once tokens reached the client, a
failed worker ends the request with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from draftwise.gateway.admission import Admission
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.metrics import GatewayMetrics
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
    _ids: itertools.count = field(default_factory=itertools.count)

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


class RequestError(Exception):
    """A request ends with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
        outbox: Outbox,
        timeout_s: float | None,
    ) -> None:
        self.core = core
        self.request_id = request_id
        self.model = model
        self.outbox = outbox
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.request = wpb.WorkerServiceGenerateRequest(start=start)
        self.request.start.request_id = core.worker_request_id()
        self.request.start.model = model
        self.t0 = time.perf_counter()
        self.t_last = 0.0
        self.num_tokens = 0
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

    def start(self) -> asyncio.Task[None]:
        self.core.relays.add(self)
        self.core.metrics.in_flight.inc()
        self._task = asyncio.create_task(self._run(), name=f"relay-{self.request_id}")
        return self._task

    @property
    def done(self) -> bool:
        return self.final_status is not None

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
            self.core.admission.release()
            self.core.relays.discard(self)
            self.core.metrics.in_flight.dec()
            self.core.metrics.e2e_latency.observe(time.perf_counter() - self.t0)
            self.log.info(
                "request finished",
                status=self.final_status,
                output_tokens=self.num_tokens,
                worker=self.worker.address if self.worker else None,
                ms=round((time.perf_counter() - self.t0) * 1000, 1),
            )

    async def _attempts(self) -> None:
        tried: set[WorkerHandle] = set()
        while True:
            w = self.core.router.pick(self.model, frozenset(tried))
            if w is None:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no healthy worker serves model {self.model!r} ({self.core.router.describe()}); retry shortly",
                )
            tried.add(w)
            self.worker = w
            w.in_flight += 1
            try:
                if not await self._call(w):
                    return
            finally:
                w.in_flight -= 1

    # ------------------------------------------------------------------ one worker call

    async def _call(self, w: WorkerHandle) -> bool:
        """Run the request on ``w``; True when it should be retried on another worker."""
        timeout = None
        if self.deadline is not None:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request started")
        call = w.generate(self.request, timeout=timeout)
        outbox, rid = self.outbox, self.request_id
        try:
            async for resp in call:
                event = resp.event
                event.request_id = rid
                kind = event.WhichOneof("kind")
                if kind == "delta":
                    self._observe_delta(event.delta)
                    if not outbox.put_delta(rid, resp):
                        raise RequestError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the client is not reading this stream fast enough: more than "
                            f"{outbox.max_buffered_tokens} tokens of this request were waiting to be sent; "
                            "read the stream faster (or open more streams) and retry",
                        )
                elif kind == "finished":
                    self.core.metrics.observe_finished(event.finished)
                    self._final_status(_FINISH_STATUS.get(event.finished.finish_reason, "stop"))
                    outbox.put_final(rid, resp)
                    return False
                else:  # the worker sends errors as the call status, but pass one on if it comes
                    self._final_status(grpc.StatusCode.UNKNOWN.name.lower())
                    outbox.put_final(rid, resp)
                    return False
        except grpc.aio.AioRpcError as e:
            return self._on_worker_error(w, e)
        finally:
            if not call.done():
                call.cancel()  # the worker aborts the request and frees its blocks
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE, f"worker {w.address} ended the request without a final event; retry it"
        )

    def _on_worker_error(self, w: WorkerHandle, e: grpc.aio.AioRpcError) -> bool:
        code, details = e.code(), clip(e.details() or "", MAX_DETAILS_CHARS)
        S = grpc.StatusCode
        if code in (S.INTERNAL, S.UNAVAILABLE):
            self.core.metrics.engine_errors.labels(w.name).inc()
        if code == S.UNAVAILABLE:
            self.core.router.report_failure(w, f"Generate failed: {details}")
            if self.num_tokens == 0:
                self.log.warning("worker unavailable, retrying elsewhere", worker=w.address, details=details)
                return True
            raise RequestError(
                S.UNAVAILABLE,
                f"worker {w.address} became unavailable after {self.num_tokens} output tokens ({details}); "
                "the request did not complete: retry it",
            )
        if code == S.CANCELLED:
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
        if self.num_tokens == 0:
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
        self.num_tokens += n
        m.generation_tokens.inc(n)

    def _final_status(self, status: str) -> None:
        if self.final_status is None:
            self.final_status = status
            self.core.metrics.requests.labels(status).inc()

    def _emit_error(self, code: grpc.StatusCode, message: str) -> None:
        self._final_status(code.name.lower())
        if code != grpc.StatusCode.INVALID_ARGUMENT:
            self.log.warning("request failed", code=code.name, message=message)
        self.outbox.put_final(self.request_id, error_response(self.request_id, code, message))

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
        if self.num_tokens:
            t.time_to_first_token_ms = (self.t_first - self.t0) * 1000
        t.total_ms = (time.perf_counter() - self.t0) * 1000
        self.core.metrics.observe_finished(finished)
        self.outbox.put_final(
            self.request_id,
            gspb.GenerateResponse(event=pb.GenerationEvent(request_id=self.request_id, finished=finished)),
        )
