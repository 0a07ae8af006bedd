"""Cancellation and deadlines: whichever way a request ends early, the worker aborts it and
its KV blocks are free again right away."""

from __future__ import annotations

import asyncio
import time

import grpc

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.rpc import Result, cancel_req, start, start_req, wait_workers_idle, worker_loads

LONG = {"max_tokens": 450, "ignore_eos": True, "temperature": 0}
IDLE_WITHIN_S = 30.0
"""Liveness bound: a freed request's blocks are back before the next step, but a loaded
machine may take long to get there; the tests print how long it took."""
DEADLINE_S = 1.0
"""First deadline tried for a request that must be cut mid-stream: long enough for its first
token, shorter than its LONG tokens. If a slow machine got no token before it, the test
tries again with twice the deadline; if a fast one finished the request, with half."""
DEADLINE_TRIES = 5
RST_STREAM = "INTERNAL_RST_STREAM"
"""What a call may end with instead of DEADLINE_EXCEEDED: the server's deadline fired first
and reset the HTTP/2 stream, which the client's gRPC core reports as INTERNAL "Internal
error from Core" (as in tests/reliability/conftest.py)."""


def _deadline_status(code: grpc.StatusCode, details: str | None) -> str:
    """The name of a call's status; RST_STREAM for the transport's deadline race."""
    if code == grpc.StatusCode.INTERNAL and details == "Internal error from Core":
        return RST_STREAM
    return code.name


def _addresses(workers):
    return [w.address for w in workers]


async def _blocks_in_use(workers) -> int:
    return sum(lo.num_total_kv_blocks - lo.num_free_kv_blocks for lo in await worker_loads(_addresses(workers)))


def test_cancel_mid_stream_frees_blocks_within_a_step(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=60)
            await call.write(start_req(start("long", **LONG)))
            await call.write(start_req(start("short", max_tokens=5, temperature=0)))
            results = {"long": Result("long"), "short": Result("short")}
            while len(results["long"].token_ids) < 5:
                ev = (await call.read()).event
                results[ev.request_id].add(ev)
            in_use = await _blocks_in_use(workers)
            await call.write(cancel_req("long"))
            await call.write(cancel_req("no-such-request"))  # ignored
            while results["long"].final is None or results["short"].final is None:
                ev = (await call.read()).event
                results[ev.request_id].add(ev)
            t_abort = time.monotonic()
            idle_after = await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
            # the stream is still usable after a cancel
            await call.write(start_req(start("after", max_tokens=3, temperature=0)))
            after = Result("after")
            while after.final is None:
                after.add((await call.read()).event)
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            return results, in_use, idle_after, t_abort, after

    results, in_use, idle_after, _, after = asyncio.run(main())
    long = results["long"]
    assert in_use > 0
    assert long.finish_reason == pb.FINISH_REASON_ABORT
    assert 5 <= len(long.token_ids) < LONG["max_tokens"]
    assert long.final.finished.usage.completion_tokens == len(long.token_ids)
    assert results["short"].finish_reason == pb.FINISH_REASON_LENGTH
    print(f"blocks free {idle_after * 1e3:.1f} ms after the ABORT event")
    assert after.finish_reason == pb.FINISH_REASON_LENGTH


def test_cancelling_the_whole_stream_aborts_its_requests(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=60)
            for i in range(4):
                await call.write(start_req(start(f"r{i}", **LONG)))
            seen = 0
            while seen < 8:
                await call.read()
                seen += 1
            in_use = await _blocks_in_use(workers)
            call.cancel()
            return in_use, await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)

    in_use, idle_after = asyncio.run(main())
    print(f"blocks free {idle_after * 1e3:.1f} ms after the cancel")
    assert in_use > 0


def test_generate_stream_cancel_frees_blocks(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).GenerateStream(
                gspb.GenerateStreamRequest(start=start("", **LONG)), timeout=60
            )
            for _ in range(3):
                await call.read()
            in_use = await _blocks_in_use(workers)
            call.cancel()
            return in_use, await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)

    in_use, idle_after = asyncio.run(main())
    print(f"blocks free {idle_after * 1e3:.1f} ms after the cancel")
    assert in_use > 0


def test_deadline_exceeded_and_blocks_freed(gateway, workers):
    """A deadline that strikes mid-stream ends GenerateStream with DEADLINE_EXCEEDED (or the
    transport's reset when the server's deadline wins the race) and aborts the request; the
    same deadline on a bidi stream reaches its requests too. Either way the blocks come back."""

    async def generate_stream(stub, deadline: float) -> tuple[int, str]:
        call = stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", **LONG)), timeout=deadline)
        n = 0
        try:
            async for _ in call:
                n += 1
        except grpc.aio.AioRpcError as e:
            return n, _deadline_status(e.code(), e.details())
        return n, "OK"

    async def main():
        await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            tries, deadline = [], DEADLINE_S
            for _ in range(DEADLINE_TRIES):
                n, status = await generate_stream(stub, deadline)
                tries.append((deadline, n, status))
                idle_after = await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
                if n == 0:
                    deadline *= 2  # no token yet: too short for this machine
                elif status == "OK":
                    deadline /= 2  # the whole request fitted in
                else:
                    break  # cut mid-stream
            # the bidi stream's deadline reaches its requests too (it ends only by the deadline)
            bidi = stub.Generate(timeout=deadline)
            await bidi.write(start_req(start("x", **LONG)))
            try:
                while True:
                    if await bidi.read() == grpc.aio.EOF:
                        break
            except grpc.aio.AioRpcError:
                pass
            bidi_status = _deadline_status(await bidi.code(), await bidi.details())
            bidi_idle_after = await wait_workers_idle(_addresses(workers), timeout=IDLE_WITHIN_S)
            return tries, idle_after, bidi_status, bidi_idle_after

    tries, idle_after, bidi_status, bidi_idle_after = asyncio.run(main())
    print(f"(deadline s, deltas, status) tries: {tries}; blocks free {idle_after * 1e3:.1f} ms after the deadline")
    print(f"bidi: {bidi_status}, blocks free {bidi_idle_after * 1e3:.1f} ms after it")
    _, n, status = tries[-1]
    assert n > 0 and status in ("DEADLINE_EXCEEDED", RST_STREAM), tries
    assert bidi_status in ("DEADLINE_EXCEEDED", RST_STREAM)
