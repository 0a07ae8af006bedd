"""The asyncio client.

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate("def fibonacci(n):", SamplingParams(max_tokens=64, temperature=0)):
            print(delta.text, end="", flush=True)

``generate`` runs one request per call (``GenerateStream``). ``session()`` opens one
multiplexed ``Generate`` stream for many concurrent requests, each cancellable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from draftwise_client._aio_session import Session
from draftwise_client._common import HEALTH_CHECK, SERVING, Connection, empty, health_status
from draftwise_client._core import (
    Done,
    Failed,
    Raise,
    RequestCore,
    Resume,
    Retry,
    Send,
    Yield,
    stream_request,
)
from draftwise_client._proto import generate_service_pb2 as gspb
from draftwise_client._proto import generate_service_pb2_grpc as gsgrpc
from draftwise_client._proto import generation_pb2 as pb
from draftwise_client._resume import DEFAULT_RESUME, ResumePolicy, log
from draftwise_client._retry import DEFAULT_RETRY, RetryPolicy
from draftwise_client._types import (
    Collector,
    Completion,
    Delta,
    GenerationError,
    ModelInfo,
    SamplingParams,
    chat_prompt,
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
        now = time.monotonic()
        core = RequestCore(
            start_message(prompt, params, model, request_id),
            retry=self.retry,
            resume=self.resume,
            deadline=None if timeout is None else now + timeout,
        )
        action: Send | Retry | Resume | Raise | Done = core.begin()
        while isinstance(action, Send | Retry | Resume):
            if not isinstance(action, Send):
                await asyncio.sleep(action.delay_s)
            if isinstance(action, Resume):
                how = "continuing as a continuation" if action.start is not None else f"resuming {action.handle}"
                log.info("%s at token %d after %s", how, action.next_index, action.error)
            call = self._stub.GenerateStream(
                stream_request(action), metadata=self.connection.metadata, timeout=core.timeout(time.monotonic())
            )
            try:
                async for resp in call:
                    step = core.received(resp.event, time.monotonic())
                    if not isinstance(step, Yield):
                        action = step  # a gap (DATA_LOSS), or a refusal to retry
                        break
                    for delta in step.deltas:
                        yield delta
                else:
                    action = core.ended()
            except grpc.aio.AioRpcError as e:
                action = core.failed(Failed.from_rpc(e), time.monotonic())
            finally:
                if not call.done():
                    call.cancel()
        if isinstance(action, Raise):
            raise action.error from None

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream the reply to a conversation: ``messages`` are ``{"role": ..., "content": ...}``
        dicts, oldest first, which the server renders with the model's chat template (the reply
        ends at the template's end-of-turn token). As ``generate`` otherwise; a model without a
        chat template, no messages or a role the template does not know raise GenerationError
        (INVALID_ARGUMENT), a malformed list ValueError. ``tools`` are OpenAI-style function tools
        (``{"type": "function", "function": {"name", "description", "parameters"}}``), rendered
        into the prompt by the server; messages may carry an assistant's ``tool_calls`` and a
        tool result (``role: "tool"``, ``tool_call_id``) as OpenAI has them."""
        prompt = chat_prompt(messages, tools)
        return self.generate(prompt, params, model=model, request_id=request_id, timeout=timeout)

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
        """Many requests multiplexed on one ``Generate`` stream, each with its own deltas:
        ``async with client.session() as s: r = await s.generate(...)`` (``timeout`` covers
        the whole stream, reconnections included)."""
        return Session(self, timeout)
