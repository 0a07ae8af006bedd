"""The Python client retries a request the server refused before its first token
(RESOURCE_EXHAUSTED, UNAVAILABLE), with backoff that honours the server's hint, a bounded
number of times, and never once a token arrived; against a real gateway whose admission
limit is one request."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from tests.integration.procs import CLIENT_DIR, metrics_port, start_gateway, start_workers
from tests.integration.rpc import cancel_req, start, start_req

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import AsyncClient, Client, GenerationError, RetryPolicy, SamplingParams  # noqa: E402

HINT_MS = 100
PARAMS = SamplingParams(max_tokens=4, temperature=0)
REFUSED = 'draftwise_requests_total{status="resource_exhausted"}'
REFUSALS = 2
"""Refusals the gateway counts before the held slot is given up: the client surely retried."""
PATIENT = RetryPolicy(max_attempts=10, max_backoff_s=1.0)
"""Attempts enough (over ~7 s) to outlast the slot's release on a slow machine."""


@pytest.fixture(scope="module")
def one_slot(workers, proc_dir):
    g = start_gateway(workers, proc_dir, "gateway-retry", "--max-in-flight=1", f"--retry-after-ms={HINT_MS}")
    yield g
    g.stop()


def _refusals(gateway) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(gateway)}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(REFUSED + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


@asynccontextmanager
async def holding_the_slot(gateway, refusals: int | None = None) -> AsyncIterator[None]:
    """A raw request takes the gateway's only slot and holds it until the gateway has refused
    ``refusals`` more requests (None: until the block exits), whatever the machine's speed."""
    async with grpc.aio.insecure_channel(gateway.address) as ch:
        call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=60)
        await call.write(start_req(start("hold", max_tokens=450, ignore_eos=True, temperature=0)))
        await call.read()  # its first delta: it is admitted and running
        before = await asyncio.to_thread(_refusals, gateway)

        async def release() -> None:
            await call.write(cancel_req("hold"))
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass

        async def release_after_refusals() -> None:
            while await asyncio.to_thread(_refusals, gateway) < before + refusals:
                await asyncio.sleep(0.02)
            await release()

        releaser = asyncio.create_task(release_after_refusals()) if refusals is not None else None
        try:
            yield
        except BaseException:
            if releaser is not None:
                releaser.cancel()
            raise
        await (release() if releaser is None else releaser)


def test_generate_retries_until_admitted(one_slot):
    async def main():
        async with holding_the_slot(one_slot, REFUSALS), AsyncClient(one_slot.address, retry=PATIENT) as client:
            t0 = time.perf_counter()
            completion = await client.complete("def f(x):", PARAMS, timeout=30)
            return completion, time.perf_counter() - t0

    before = _refusals(one_slot)
    completion, seconds = asyncio.run(main())
    refused = _refusals(one_slot) - before
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    assert REFUSALS <= refused < PATIENT.max_attempts  # refused while the slot was held, then admitted
    assert seconds >= refused * HINT_MS / 1000  # it waited at least the hint each time


def test_session_requests_retry_until_admitted(one_slot):
    async def main():
        async with AsyncClient(one_slot.address, retry=PATIENT) as client, holding_the_slot(one_slot, REFUSALS):
            session = client.session(timeout=30)
            async with session as s:
                stream = await s.generate("class Stack:", PARAMS)
                completion = await stream.complete()
            return completion, stream.attempts

    before = _refusals(one_slot)
    completion, attempts = asyncio.run(main())
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    assert attempts > REFUSALS and _refusals(one_slot) - before == attempts - 1


def test_blocking_session_requests_retry_until_admitted(one_slot):
    def blocking() -> tuple[object, int]:
        with Client(one_slot.address, retry=PATIENT) as client, client.session(timeout=30) as s:
            stream = s.generate("class Stack:", PARAMS)
            return stream.complete(), stream.attempts

    async def main():
        async with holding_the_slot(one_slot, REFUSALS):
            return await asyncio.to_thread(blocking)

    before = _refusals(one_slot)
    completion, attempts = asyncio.run(main())
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    assert attempts > REFUSALS and _refusals(one_slot) - before == attempts - 1


def test_blocking_client_retries_until_admitted(one_slot):
    def blocking() -> object:
        with Client(one_slot.address, retry=PATIENT) as client:
            return client.complete("import os", PARAMS, timeout=30)

    async def main():
        async with holding_the_slot(one_slot, REFUSALS):
            return await asyncio.to_thread(blocking)

    before = _refusals(one_slot)
    completion = asyncio.run(main())
    assert completion.finish_reason == "length" and _refusals(one_slot) - before >= REFUSALS


def test_attempts_are_bounded_and_retries_can_be_turned_off(one_slot):
    async def attempt(policy: RetryPolicy | None) -> tuple[GenerationError, float]:
        async with AsyncClient(one_slot.address, retry=policy) as client:
            t0 = time.perf_counter()
            with pytest.raises(GenerationError) as info:
                await client.complete("def g():", PARAMS, timeout=30)
            return info.value, time.perf_counter() - t0

    async def main():
        async with holding_the_slot(one_slot):  # held until both have given up
            bounded = await attempt(RetryPolicy(max_attempts=3, initial_backoff_s=0.01))
            off = await attempt(None)
            return bounded, off

    (bounded, bounded_s), (off, _) = asyncio.run(main())
    for e in (bounded, off):
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_ms == HINT_MS
    assert bounded.attempts == 3 and bounded_s >= 2 * HINT_MS / 1000  # the hint beats the 10 ms backoff
    assert off.attempts == 1


def test_never_retried_after_a_token(proc_dir):
    """A worker that dies mid-request: UNAVAILABLE after tokens is raised, not retried (a
    retry would end with "no healthy worker", the only worker being gone)."""
    (victim,) = start_workers(1, proc_dir, prefix="retry-victim")
    try:
        gw = start_gateway([victim], proc_dir, "gateway-retry-victim")
    except BaseException:
        victim.kill()
        raise
    try:

        async def main():
            async with AsyncClient(gw.address, retry=RetryPolicy(initial_backoff_s=0.05)) as client:
                got = 0
                with pytest.raises(GenerationError) as info:
                    async for delta in client.generate(
                        "def f(x):", SamplingParams(max_tokens=400, ignore_eos=True, temperature=0), timeout=60
                    ):
                        got += len(delta.token_ids)
                        if got >= 2 and victim.popen.poll() is None:
                            victim.kill()
                return info.value, got

        error, got = asyncio.run(main())
    finally:
        gw.stop()
        victim.kill()
    assert got >= 2
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.attempts == 1
    assert "became unavailable after" in error.message, error.message
