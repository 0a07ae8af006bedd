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

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
IDLE_WITHIN_S = 1.0
"""A freed request's blocks are back before the next step; polling allows some slack."""


def _addresses(workers):
    return [w.address for w in workers]


async def _blocks_in_use(workers) -> int:
    return sum(lo.num_total_kv_blocks - lo.num_free_kv_blocks for lo in await worker_loads(_addresses(workers)))


def test_cancel_mid_stream_frees_blocks_within_a_step(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers))
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
            idle_after = await wait_workers_idle(_addresses(workers), timeout=5)
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
    assert 5 <= len(long.token_ids) < 400
    assert long.final.finished.usage.completion_tokens == len(long.token_ids)
    assert results["short"].finish_reason == pb.FINISH_REASON_LENGTH
    assert idle_after < IDLE_WITHIN_S, f"blocks came back after {idle_after:.3f} s"
    print(f"blocks free {idle_after * 1e3:.1f} ms after the ABORT event")
    assert after.finish_reason == pb.FINISH_REASON_LENGTH


def test_cancelling_the_whole_stream_aborts_its_requests(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers))
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
            return in_use, await wait_workers_idle(_addresses(workers), timeout=5)

    in_use, idle_after = asyncio.run(main())
    assert in_use > 0 and idle_after < IDLE_WITHIN_S


def test_generate_stream_cancel_frees_blocks(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers))
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).GenerateStream(
                gspb.GenerateStreamRequest(start=start("", **LONG)), timeout=60
            )
            for _ in range(3):
                await call.read()
            in_use = await _blocks_in_use(workers)
            call.cancel()
            return in_use, await wait_workers_idle(_addresses(workers), timeout=5)

    in_use, idle_after = asyncio.run(main())
    assert in_use > 0 and idle_after < IDLE_WITHIN_S


def test_deadline_exceeded_and_blocks_freed(gateway, workers):
    async def main():
        await wait_workers_idle(_addresses(workers))
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", **LONG)), timeout=0.5)
            n = 0
            try:
                async for _ in call:
                    n += 1
            except grpc.aio.AioRpcError as e:
                code = e.code()
            else:
                code = grpc.StatusCode.OK
            # the bidi stream's deadline reaches its requests too
            bidi = stub.Generate(timeout=0.5)
            await bidi.write(start_req(start("x", **LONG)))
            try:
                while True:
                    if await bidi.read() == grpc.aio.EOF:
                        break
            except grpc.aio.AioRpcError:
                pass
            bidi_code = await bidi.code()
            return n, code, bidi_code, await wait_workers_idle(_addresses(workers), timeout=5)

    n, code, bidi_code, idle_after = asyncio.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and n > 0
    assert bidi_code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert idle_after < IDLE_WITHIN_S
