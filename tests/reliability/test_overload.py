"""Overload: 1,000 concurrent streams (GenerateStream calls, or Generate streams of one request
each) against a gateway that admits 16 requests at a time, in front of two real workers. The excess is refused with RESOURCE_EXHAUSTED carrying the
standard retry hint (``grpc-retry-pushback-ms`` trailer and a ``google.rpc.RetryInfo``
detail), fast; every admitted request completes; gateway and worker memory stay bounded.

Figures (rejection latency, statuses, peak RSS) are printed: ``pytest -s`` shows them.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import Proc, start_gateway, start_workers
from tests.integration.rpc import start, wait_workers_idle

NUM_STREAMS = 1000
MAX_IN_FLIGHT = 16
RETRY_AFTER_MS = 200
MAX_TOKENS = 8
CHANNELS = 4  # client connections the streams are spread over
BURST = 4000  # calls started at once on one connection (past gRPC's default of 1,000 pending calls)
GATEWAY_RSS_LIMIT_MIB = 400
WORKER_RSS_LIMIT_MIB = 3072


@dataclass
class Outcome:
    code: grpc.StatusCode
    seconds: float  # call start to its end
    tokens: int = 0
    finish_reason: int = 0
    pushback: str | None = None
    retry_info_ms: int | None = None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Proc], Proc]]:
    tmp = tmp_path_factory.mktemp("overload")
    workers = start_workers(2, tmp, prefix="overload-worker")
    try:
        gateway = start_gateway(
            workers, tmp, "overload-gateway", f"--max-in-flight={MAX_IN_FLIGHT}", f"--retry-after-ms={RETRY_AFTER_MS}"
        )
    except BaseException:
        for w in workers:
            w.kill()
        raise
    yield workers, gateway
    gateway.stop()
    for w in workers:
        w.stop()


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set size (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


async def one(stub: gsgrpc.GenerateServiceStub, i: int) -> Outcome:
    req = gspb.GenerateStreamRequest(start=start("", f"# {i}\ndef f(x):", max_tokens=MAX_TOKENS, temperature=0))
    t0 = time.perf_counter()
    call = stub.GenerateStream(req, timeout=80)
    out = Outcome(grpc.StatusCode.OK, 0.0)
    try:
        async for resp in call:
            ev = resp.event
            if ev.WhichOneof("kind") == "delta":
                out.tokens += len(ev.delta.token_ids)
            elif ev.WhichOneof("kind") == "finished":
                out.finish_reason = ev.finished.finish_reason
    except grpc.aio.AioRpcError as e:
        out.code = e.code()
        out.pushback = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        status = rpc_status.from_call(e)
        for detail in status.details if status is not None else ():
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                out.retry_info_ms = info.retry_delay.ToMilliseconds()
    out.seconds = time.perf_counter() - t0
    return out


async def one_multiplexed(stub: gsgrpc.GenerateServiceStub, i: int) -> Outcome:
    """One Generate stream with one request: a refusal is that request's error event (with
    ``retry_after_ms``), the stream itself ends OK."""
    s = start("r", f"# {i}\ndef f(x):", max_tokens=MAX_TOKENS, temperature=0)
    t0 = time.perf_counter()
    call = stub.Generate(timeout=80)
    await call.write(gspb.GenerateRequest(start=s))
    await call.done_writing()
    out = Outcome(grpc.StatusCode.OK, 0.0)
    while (resp := await call.read()) != grpc.aio.EOF:
        ev = resp.event
        kind = ev.WhichOneof("kind")
        if kind == "delta":
            out.tokens += len(ev.delta.token_ids)
        elif kind == "finished":
            out.finish_reason = ev.finished.finish_reason
        else:
            out.code = next(c for c in grpc.StatusCode if c.value[0] == ev.error.code)
            out.seconds = time.perf_counter() - t0
            out.pushback = str(ev.error.retry_after_ms)
            out.retry_info_ms = ev.error.retry_after_ms
    assert await call.code() == grpc.StatusCode.OK
    out.seconds = out.seconds or time.perf_counter() - t0
    return out


async def burst(address: str, kind: str) -> tuple[list[Outcome], float]:
    channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    try:
        stubs = [gsgrpc.GenerateServiceStub(ch) for ch in channels]
        for ch in channels:
            await ch.channel_ready()
        t0 = time.perf_counter()
        call = one if kind == "GenerateStream" else one_multiplexed
        outcomes = await asyncio.gather(*(call(stubs[i % CHANNELS], i) for i in range(NUM_STREAMS)))
        return outcomes, time.perf_counter() - t0
    finally:
        for ch in channels:
            await ch.close()


async def burst_codes(address: str, n: int) -> collections.Counter[str]:
    """The statuses of ``n`` GenerateStream calls started at once over one connection."""

    async def call(stub: gsgrpc.GenerateServiceStub, i: int) -> str:
        req = gspb.GenerateStreamRequest(start=start("", f"# {i}", max_tokens=2, temperature=0))
        try:
            async for _ in stub.GenerateStream(req, timeout=80):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return "OK"

    async with grpc.aio.insecure_channel(address) as ch:
        await ch.channel_ready()
        stub = gsgrpc.GenerateServiceStub(ch)
        return collections.Counter(await asyncio.gather(*(call(stub, i) for i in range(n))))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@pytest.mark.parametrize("kind", ["GenerateStream", "Generate"])
def test_overload_is_refused_fast_with_the_retry_hint(cluster, kind):
    workers, gateway = cluster
    outcomes, wall = asyncio.run(burst(gateway.address, kind))
    codes = collections.Counter(o.code.name for o in outcomes)
    admitted = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    rss_gateway = peak_rss_mib(gateway.popen.pid)
    rss_workers = [peak_rss_mib(w.popen.pid) for w in workers]
    rej = [o.seconds * 1000 for o in refused]
    ok = [o.seconds * 1000 for o in admitted]
    print(
        f"\noverload ({kind}): {NUM_STREAMS} streams, max in flight {MAX_IN_FLIGHT}, wall {wall:.1f} s; statuses {dict(codes)}"
        f"\n  rejection latency ms: median {statistics.median(rej):.1f}, p99 {pct(rej, 0.99):.1f}, max {max(rej):.1f}"
        f"\n  admitted latency ms: median {statistics.median(ok):.1f}, p99 {pct(ok, 0.99):.1f}"
        f"\n  peak RSS MiB: gateway {rss_gateway:.0f}, workers {', '.join(f'{r:.0f}' for r in rss_workers)}"
    )
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert len(admitted) >= MAX_IN_FLIGHT and refused, codes
    for o in admitted:  # everything admitted completed
        assert o.finish_reason == pb.FINISH_REASON_LENGTH and o.tokens == MAX_TOKENS, o
    for o in refused:
        assert o.pushback == str(RETRY_AFTER_MS) and o.retry_info_ms == RETRY_AFTER_MS, o
    assert rss_gateway < GATEWAY_RSS_LIMIT_MIB and max(rss_workers) < WORKER_RSS_LIMIT_MIB
    asyncio.run(wait_workers_idle([w.address for w in workers], timeout=30))


def test_a_burst_past_grpcs_pending_limit_gets_answers_not_cancelled(cluster):
    """gRPC drops calls that wait for the event loop past its pending-request limit (1,000 by
    default) with a bare CANCELLED, which no client can act on: every call of a burst must
    get a real status (here RESOURCE_EXHAUSTED with the hint, or OK)."""
    _, gateway = cluster
    t0 = time.perf_counter()
    codes = asyncio.run(burst_codes(gateway.address, BURST))
    print(f"\nburst: {BURST} calls at once in {time.perf_counter() - t0:.1f} s: {dict(codes)}")
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
