"""The asyncio client.

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate("def fibonacci(n):", SamplingParams(max_tokens=64, temperature=0)):
            print(delta.text, end="", flush=True)

``generate`` runs one request per call (``GenerateStream``). ``session()`` opens one
multiplexed ``Generate`` stream for many concurrent requests, each cancellable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType

import grpc

from draftwise_client._common import HEALTH_CHECK, SERVING, Connection, empty, health_status
from draftwise_client._proto import generate_service_pb2 as gspb
from draftwise_client._proto import generate_service_pb2_grpc as gsgrpc
from draftwise_client._proto import generation_pb2 as pb
from draftwise_client._resume import DEFAULT_RESUME, Progress, ResumePolicy, log, resume_delay, resume_outcome
from draftwise_client._retry import DEFAULT_RETRY, RetryPolicy, retry_delay
from draftwise_client._types import (
    Collector,
    Completion,
    Delta,
    GenerationError,
    ModelInfo,
    SamplingParams,
    chat_prompt,
    delta_from_event,
    start_message,
)


class AsyncClient:
    """A connection to a draftwise gateway (one gRPC channel)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        options: Sequence[tuple[str, int | str]] = (),
        retry: RetryPolicy | None = DEFAULT_RETRY,
        resume: ResumePolicy | None = DEFAULT_RESUME,
    ) -> None:
        """``retry``: how requests refused before their first token (RESOURCE_EXHAUSTED,
        UNAVAILABLE) are retried; None or ``RetryPolicy.off()``: never. ``resume``: how
        requests whose connection dropped after their first delta are resumed; None or
        ``ResumePolicy.off()``: never (the error is raised)."""
        self.connection = Connection(target, api_key, tls, root_certificates, tuple(options))
        self.retry = retry or RetryPolicy.off()
        self.resume = resume or ResumePolicy.off()
        creds = self.connection.credentials
        if creds is None:
            self.channel = grpc.aio.insecure_channel(target, options=list(options))
        else:
            self.channel = grpc.aio.secure_channel(target, creds, options=list(options))
        self._stub = gsgrpc.GenerateServiceStub(self.channel)
        self._health = self.channel.unary_unary(HEALTH_CHECK, request_serializer=empty, response_deserializer=bytes)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the server reports SERVING; GenerationError(UNAVAILABLE) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                data = await self._health(b"", timeout=2.0)
                if health_status(data) == SERVING:
                    return
                last = "not serving"
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"{self.connection.target} is not ready ({last})")
            await asyncio.sleep(0.2)

    async def list_models(self, timeout: float | None = 10.0) -> list[ModelInfo]:
        try:
            resp = await self._stub.ListModels(
                gspb.ListModelsRequest(), metadata=self.connection.metadata, timeout=timeout
            )
        except grpc.aio.AioRpcError as e:
            raise GenerationError.from_rpc(e) from None
        return [ModelInfo.from_proto(m) for m in resp.models]

    async def generate(
        self,
        prompt: str | Sequence[int] | pb.Prompt,
        params: SamplingParams | None = None,
        *,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream one request's deltas (the last has ``finish_reason``). Raises GenerationError.
        Leaving the loop early cancels the request on the server. A refusal before the first
        delta is retried as the client's RetryPolicy says; a connection that drops after it is
        resumed as its ResumePolicy says (no delta lost or repeated); both within ``timeout``
        (which covers every attempt)."""
        start = gspb.GenerateStreamRequest(start=start_message(prompt, params, model, request_id))
        deadline = None if timeout is None else time.monotonic() + timeout
        progress = Progress(request_id)
        attempt = 0  # sends of the start
        in_row = 0  # resumes since the last event
        while True:
            if progress.resumable:
                req = gspb.GenerateStreamRequest(resume=progress.resume_message())
            else:
                attempt += 1
                req = start
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self._stub.GenerateStream(req, metadata=self.connection.metadata, timeout=remaining)
            try:
                async for resp in call:
                    if progress.accept(resp.event):
                        in_row = 0
                        yield delta_from_event(resp.event)
                return
            except grpc.aio.AioRpcError as e:
                if progress.finished:
                    return  # the connection broke after the final event: nothing is missing
                error = GenerationError.from_rpc(e, request_id)
                error.attempts, error.resumes = attempt, progress.resumes
                error = resume_outcome(error, progress.cause)
                if progress.resumable:
                    in_row += 1
                    delay = resume_delay(self.resume, error, in_row, deadline)
                else:
                    delay = retry_delay(self.retry, error, attempt, progress.received, deadline)
                if delay is None:
                    raise error from None
            finally:
                if not call.done():
                    call.cancel()
            await asyncio.sleep(delay)
            if progress.resumable:
                progress.resumes += 1
                progress.cause = error
                log.info("resuming %s at token %d after %s", progress.handle, progress.next_index, error)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams | None = None,
        *,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream the reply to a conversation: ``messages`` are ``{"role": ..., "content": ...}``
        dicts, oldest first, which the server renders with the model's chat template (the reply
        ends at the template's end-of-turn token). As ``generate`` otherwise; a model without a
        chat template, no messages or a role the template does not know raise GenerationError
        (INVALID_ARGUMENT), a malformed list ValueError."""
        return self.generate(chat_prompt(messages), params, model=model, request_id=request_id, timeout=timeout)

    async def complete(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        model: str = "",
        timeout: float | None = None,
    ) -> Completion:
        """The whole output of one request."""
        acc = Collector()
        async for delta in self.generate(prompt, params, model=model, timeout=timeout):
            acc.add(delta)
        return acc.result()

    def session(self, timeout: float | None = None) -> Session:
        """A multiplexed stream: ``async with client.session() as s: r = await s.generate(...)``."""
        return Session(self, timeout)


class RequestStream:
    """The deltas of one request of a :class:`Session` (an async iterator)."""

    def __init__(self, session: Session, request_id: str, start: pb.StartGeneration) -> None:
        self.session = session
        self.request_id = request_id
        self._start = start
        self._queue: asyncio.Queue[pb.GenerationEvent | GenerationError] = asyncio.Queue()
        self._done = False
        self._received = False  # a delta arrived: never retried from then on
        self._cancelled = False
        self.progress = Progress(request_id)
        """Its resume handle and the tokens received (read by the session's reader)."""
        self.attempts = 1
        """Times the request was sent (retries after a refusal, and sends again on a new stream
        when the old one broke before its first delta, included)."""

    @property
    def resumes(self) -> int:
        """Times the request was resumed on a new stream after its connection dropped."""
        return self.progress.resumes

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        while True:
            item = await self._queue.get()
            if isinstance(item, GenerationError):
                self._done = True
                raise item
            if item.WhichOneof("kind") != "error":
                break
            error = GenerationError.from_event(item.request_id, item.error)
            error.attempts = self.attempts
            delay = None if self._cancelled else retry_delay(self.session.retry, error, self.attempts, self._received)
            if delay is None:
                self._done = True
                raise error
            await asyncio.sleep(delay)  # refused before its first token: send it again
            self.attempts += 1
            await self.session._send_start(self)
        delta = delta_from_event(item)
        self._received = True
        self._done = delta.finished
        return delta

    async def cancel(self) -> None:
        """Ask the server to stop this request; its last delta then says "abort"."""
        self._cancelled = True
        # should the stream have broken, the session's reconnection sends the cancel again
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.session._write(gspb.GenerateRequest(cancel=pb.CancelGeneration(request_id=self.request_id)))

    async def complete(self) -> Completion:
        acc = Collector()
        async for delta in self:
            acc.add(delta)
        return acc.result()


class Session:
    """One ``Generate`` stream carrying many requests. Closing it half-closes the stream and
    waits for the in-flight requests to finish. Should the stream break (the connection
    dropped), the session opens a new one and resumes every in-flight request on it, as the
    client's ResumePolicy says; requests that had no delta yet are sent again."""

    def __init__(self, client: AsyncClient, timeout: float | None) -> None:
        self.client = client
        self._call: grpc.aio.StreamStreamCall | None = None
        self._timeout = timeout
        self._deadline: float | None = None
        self._requests: dict[str, RequestStream] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._write_lock = asyncio.Lock()
        self._half_closed = False
        self.retry = client.retry
        self.reconnects = 0
        """Times the stream broke and the session opened a new one."""

    def _open(self) -> grpc.aio.StreamStreamCall:
        remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        return self.client._stub.Generate(metadata=self.client.connection.metadata, timeout=remaining)

    async def __aenter__(self) -> Session:
        self._deadline = None if self._timeout is None else time.monotonic() + self._timeout
        self._call = self._open()
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._call is not None and self._reader is not None
        if exc_type is None:
            async with self._write_lock:
                self._half_closed = True
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await self._call.done_writing()
            await self._reader
        else:
            self._call.cancel()
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _write(self, message: gspb.GenerateRequest) -> None:
        if self._call is None:
            raise RuntimeError("use the session inside `async with client.session() as s:`")
        async with self._write_lock:
            await self._call.write(message)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        model: str = "",
        request_id: str | None = None,
    ) -> RequestStream:
        """Start a request on the stream; iterate the returned RequestStream for its deltas."""
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid, start_message(prompt, params, model, rid))
        await self._send_start(stream)
        return stream

    async def _send_start(self, stream: RequestStream) -> None:
        self._requests[stream.request_id] = stream
        await self._write(gspb.GenerateRequest(start=stream._start))

    def _dispatch(self, event: pb.GenerationEvent) -> None:
        stream = self._requests.get(event.request_id)
        if stream is None:
            return
        cause = stream.progress.cause
        if event.WhichOneof("kind") == "error" and cause is not None:
            del self._requests[event.request_id]
            error = GenerationError.from_event(event.request_id, event.error)
            error.attempts, error.resumes = stream.attempts, stream.resumes
            stream._queue.put_nowait(resume_outcome(error, cause))
            return
        try:
            if not stream.progress.accept(event):
                return  # replayed after a resume: the caller has it
        except GenerationError as e:
            del self._requests[event.request_id]
            stream._queue.put_nowait(e)
            return
        stream._queue.put_nowait(event)
        if event.WhichOneof("kind") != "delta":
            del self._requests[event.request_id]

    async def _reconnect(self, cause: GenerationError) -> None:
        """A new stream carrying every in-flight request: resumed where it has a handle,
        started again where it had no delta yet (nothing of it reached the caller)."""
        async with self._write_lock:
            self.reconnects += 1
            self._call = self._open()
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):  # read says so
                for rid, stream in list(self._requests.items()):
                    if stream.progress.resumable:
                        stream.progress.resumes += 1
                        stream.progress.cause = cause
                        resume = stream.progress.resume_message(rid)
                        await self._call.write(gspb.GenerateRequest(resume=resume))
                        log.info("resuming %s as %s at token %d", resume.resume_handle, rid, resume.next_token_index)
                        if stream._cancelled:
                            await self._call.write(gspb.GenerateRequest(cancel=pb.CancelGeneration(request_id=rid)))
                    else:
                        stream.attempts += 1
                        await self._call.write(gspb.GenerateRequest(start=stream._start))
                if self._half_closed:
                    await self._call.done_writing()

    async def _read(self) -> None:
        assert self._call is not None
        error: GenerationError | None = None
        in_row = 0  # reconnections since the last event
        try:
            while True:
                try:
                    async for resp in self._call:
                        in_row = 0
                        self._dispatch(resp.event)
                    break
                except grpc.aio.AioRpcError as e:
                    error = GenerationError.from_rpc(e)
                    if not self._requests:
                        break
                    in_row += 1
                    delay = resume_delay(self.client.resume, error, in_row, self._deadline)
                    if delay is None:
                        break
                    cause, error = error, None
                    await asyncio.sleep(delay)
                    await self._reconnect(cause)
        except asyncio.CancelledError:
            error = GenerationError(grpc.StatusCode.CANCELLED, "the session was closed")
        finally:
            for rid, stream in self._requests.items():
                stream._queue.put_nowait(
                    error
                    or GenerationError(grpc.StatusCode.UNKNOWN, "the stream ended before this request finished", rid)
                )
            self._requests.clear()
