"""Python client of the draftwise LLM inference server: async and blocking, over gRPC,
without torch.

    from draftwise_client import AsyncClient, Client, SamplingParams

    with Client("127.0.0.1:50051") as client:
        for delta in client.generate("def fibonacci(n):", SamplingParams(max_tokens=64, temperature=0)):
            print(delta.text, end="", flush=True)
        with client.session() as s:                # many requests on one stream
            a = s.generate("import os")
            b = s.generate("class Stack:")
            print(a.complete().text, b.complete().text)

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate("def fibonacci(n):"):
            print(delta.text, end="", flush=True)
        async with client.session() as s:          # many requests on one stream
            a = await s.generate("import os")
            b = await s.generate("class Stack:")
            print((await a.complete()).text, (await b.complete()).text)

Errors raise :class:`GenerationError` carrying the gRPC status code and the server's message.
A request refused before its first token (RESOURCE_EXHAUSTED, UNAVAILABLE) is retried with
exponential backoff and jitter, honouring the server's retry hint (:class:`RetryPolicy`;
``retry=None`` turns that off); never once a token arrived. A connection that drops after the
first delta is resumed: the client reconnects with the request's resume handle and the count of
tokens it has, and the caller sees one uninterrupted stream (:class:`ResumePolicy`;
``resume=None`` turns that off). Both clients carry out the decisions of one sans-IO core
(``draftwise_client._core``), so they retry, resume and give up in the same way.
"""

from __future__ import annotations

from draftwise_client._aio import AsyncClient
from draftwise_client._aio_session import RequestStream, Session
from draftwise_client._constraint import Constraint
from draftwise_client._resume import ResumePolicy
from draftwise_client._retry import RetryPolicy
from draftwise_client._sync import Client
from draftwise_client._sync_session import SyncRequestStream, SyncSession
from draftwise_client._types import (
    Completion,
    Delta,
    GenerationError,
    ModelInfo,
    SamplingParams,
    SpeculationStats,
    TokenLogprob,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "Constraint",
    "Delta",
    "GenerationError",
    "ModelInfo",
    "RequestStream",
    "ResumePolicy",
    "RetryPolicy",
    "SamplingParams",
    "Session",
    "SpeculationStats",
    "SyncRequestStream",
    "SyncSession",
    "TokenLogprob",
    "Usage",
]
