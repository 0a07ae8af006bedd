"""Backpressure: a client that stops reading gets its queued deltas coalesced and, past the
gateway's bound, its requests cancelled with RESOURCE_EXHAUSTED; it never slows the other
streams down."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import metrics_port, start_gateway
from tests.integration.rpc import Result, run_stream, scrape_metrics, start, start_req, wait_workers_idle

# A slow reader's requests: many large deltas (top-20 logprobs per token), more than the
# HTTP/2 flow-control window holds, so the gateway has to queue (and coalesce) them.
SLOW = {"max_tokens": 200, "ignore_eos": True, "temperature": 0, "logprobs": 20}
FAST = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}
NO_BDP = [("grpc.http2.bdp_probe", 0)]  # keep the client's receive window at its 64 KiB default
SLOW_CALL_TIMEOUT_S = 300.0
DRAIN_BOUND_S = 150.0
"""Liveness bound on the unread requests ending at the gateway (well inside the slow call's
deadline, which would end them anyway)."""


async def _read_all(call: grpc.aio.StreamStreamCall) -> dict[str, Result]:
    results: dict[str, Result] = {}
    async for resp in call:
        ev = resp.event
        results.setdefault(ev.request_id, Result(ev.request_id)).add(ev)
    return results


async def _phase(
    address: str, slow_reads: bool, before_slow_read: Callable[[], Awaitable[None]] | None = None
) -> tuple[list[float], dict[str, Result]]:
    """Three fast streams next to one slow stream; the fast streams' inter-token latencies
    (median of each) and the slow stream's results. When the slow client does not read,
    ``before_slow_read`` runs once the fast streams are done, before it reads anything."""
    async with (
        grpc.aio.insecure_channel(address) as fast_ch,
        grpc.aio.insecure_channel(address, options=NO_BDP) as slow_ch,
    ):
        slow = gsgrpc.GenerateServiceStub(slow_ch).Generate(timeout=SLOW_CALL_TIMEOUT_S)
        for i in range(4):
            await slow.write(start_req(start(f"slow{i}", f"# {i}\nimport os", **SLOW)))
        await slow.done_writing()
        slow_reader = asyncio.create_task(_read_all(slow)) if slow_reads else None
        await asyncio.sleep(0.5)  # the slow requests are running
        stub = gsgrpc.GenerateServiceStub(fast_ch)
        fast = await asyncio.gather(*(run_stream(stub, [start("f", f"# {i}\ndef f(x):", **FAST)]) for i in range(3)))
        if slow_reader is None and before_slow_read is not None:
            await before_slow_read()
        slow_results = await (slow_reader if slow_reader is not None else _read_all(slow))
    itl = []
    for res in fast:
        r = res["f"]
        assert r.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(r.token_ids) == FAST["max_tokens"]
        gaps = [b - a for a, b in zip(r.delta_times, r.delta_times[1:], strict=False)]
        itl.append(statistics.median(gaps))
    return itl, slow_results


async def _drained_while_unread(port: int, workers: list[str], length_before: float) -> float:
    """Seconds until every request has ended at the gateway (none in flight there, the four
    slow ones and the three fast ones finished by length) and the workers are idle, while the
    slow client has read nothing: the gateway drained the worker and holds the slow client's
    events itself. AssertionError after ``DRAIN_BOUND_S`` (a liveness bound, not a timing)."""
    t0 = time.monotonic()
    while True:
        m = await asyncio.to_thread(scrape_metrics, port)
        in_flight = m["draftwise_requests_in_flight"]
        if in_flight == 0:
            break
        assert time.monotonic() - t0 < DRAIN_BOUND_S, (
            f"{in_flight:g} requests still in flight at the gateway {DRAIN_BOUND_S:g} s after the fast streams "
            "ended, while their client read nothing: the relay stopped pulling from the worker"
        )
        await asyncio.sleep(0.1)
    assert m['draftwise_requests_total{status="length"}'] >= length_before + 7, m
    await wait_workers_idle(workers, timeout=30)
    return time.monotonic() - t0


def test_a_client_that_stops_reading_does_not_slow_other_streams(gateway, workers):
    """Structural, not timed (no test may depend on machine speed): in the stalled phase the
    slow client reads nothing until the three fast streams have finished, so they cannot
    have waited on it (they all end with every token); while it still reads nothing, its
    requests finish on the worker and end at the gateway (nothing in flight, the worker
    idle), so the gateway drained the worker and buffered the unread events; the stalled
    client still gets everything afterwards, its deltas merged while it was behind.
    The inter-token latencies of both phases are printed for the record."""
    addresses = [w.address for w in workers]
    port = metrics_port(gateway)
    asyncio.run(wait_workers_idle(addresses))
    base_itl, base_slow = asyncio.run(_phase(gateway.address, slow_reads=True))
    length_before = scrape_metrics(port)['draftwise_requests_total{status="length"}']
    drained_s: list[float] = []

    async def check_drained() -> None:
        drained_s.append(await _drained_while_unread(port, addresses, length_before))

    stalled_itl, stalled_slow = asyncio.run(_phase(gateway.address, slow_reads=False, before_slow_read=check_drained))
    assert drained_s, "the drain check did not run"
    base, stalled = statistics.mean(base_itl), statistics.mean(stalled_itl)
    # the stalled client still got everything, in order, its deltas merged while it was behind
    for results in (base_slow, stalled_slow):
        assert len(results) == 4
        for r in results.values():
            assert r.finish_reason == pb.FINISH_REASON_LENGTH and len(r.token_ids) == SLOW["max_tokens"]
    assert max(n for r in stalled_slow.values() for n in r.delta_sizes) > 1
    print(f"ITL {base * 1e3:.1f} ms (slow client reading) vs {stalled * 1e3:.1f} ms (stalled)")
    print(f"the unread requests ended at the gateway {drained_s[0]:.1f} s after the fast streams")


def _finished(port: int) -> float:
    """Requests the gateway has ended so far, whatever their status."""
    return sum(v for k, v in scrape_metrics(port).items() if k.startswith("draftwise_requests_total{"))


async def _until_finished(port: int, count: float, timeout: float = 300.0) -> None:
    """Wait until the gateway has ended ``count`` requests (each sent its final event)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while await asyncio.to_thread(_finished, port) < count:
        assert asyncio.get_running_loop().time() < deadline, "the requests did not end"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def tight_gateway(workers, proc_dir):
    g = start_gateway(workers, proc_dir, "gateway-tight", "--max-buffered-tokens=16")
    yield g
    g.stop()


def test_past_the_bound_a_slow_readers_requests_get_resource_exhausted(tight_gateway, workers):
    port = metrics_port(tight_gateway)

    async def main():
        before = await asyncio.to_thread(_finished, port)
        async with grpc.aio.insecure_channel(tight_gateway.address, options=NO_BDP) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            bidi = stub.Generate(timeout=120)
            for i in range(4):
                await bidi.write(start_req(start(f"s{i}", f"# {i}\nimport os", **SLOW)))
            await bidi.done_writing()
            # one request alone must outgrow the 64 KiB stream window: twice as many tokens
            single = stub.GenerateStream(
                gspb.GenerateStreamRequest(start=start("", "import sys", **{**SLOW, "max_tokens": 450})), timeout=120
            )
            # read nothing until every request has ended at the gateway: however slowly tokens
            # come, the unread deltas pass the bound once the stream's window is full
            await _until_finished(port, before + 5)
            results = await _read_all(bidi)
            code, n = grpc.StatusCode.OK, 0
            try:
                async for _ in single:
                    n += 1
            except grpc.aio.AioRpcError as e:
                code = e.code()
            return results, code, n

    results, single_code, single_events = asyncio.run(main())
    codes = [r.code for r in results.values()]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, [r.final for r in results.values()]
    for r in results.values():
        if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert "not reading" in r.final.error.message and len(r.token_ids) < SLOW["max_tokens"]
    assert single_code == grpc.StatusCode.RESOURCE_EXHAUSTED and single_events > 0
    # the cancelled requests freed their blocks
    asyncio.run(wait_workers_idle([w.address for w in workers], timeout=30))
