"""A worker that dies: its in-flight requests fail over to the survivor (none hangs, none
fails; token-exactness is tests/integration/test_failover_resume.py's), new requests go to the survivor, and health reads NOT_SERVING once no worker is left. These
tests kill workers, so they get their own."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import start_gateway, start_workers
from tests.integration.rpc import Result, run_stream, start, start_req, worker_loads

LONG = {"max_tokens": 450, "ignore_eos": True, "temperature": 0}
"""Several seconds of tokens: every request is surely still running when a worker is killed."""


@pytest.fixture(scope="module")
def cluster(proc_dir):
    workers = start_workers(2, proc_dir, prefix="doomed")
    try:
        gateway = start_gateway(workers, proc_dir, "gateway-failover", "--retry-after-ms=50")
    except BaseException:
        for w in workers:
            w.kill()
        raise
    yield workers, gateway
    gateway.stop()
    for w in workers:
        w.kill()


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def _wait_health(address: str, status: int, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await _health(address) == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"health never became {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")


def test_killed_workers(cluster):
    workers, gateway = cluster
    victim, survivor = workers

    async def main():
        assert await _health(gateway.address) == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.Generate(timeout=120)
            results = {f"r{i}": Result(f"r{i}") for i in range(6)}
            for rid in results:
                await call.write(start_req(start(rid, f"# {rid}\ndef f(x):", **LONG)))
            while not all(len(r.token_ids) >= 2 for r in results.values()):
                ev = (await call.read()).event
                results[ev.request_id].add(ev)
            loads = await worker_loads([victim.address, survivor.address])
            assert all(lo.num_requests_running > 0 for lo in loads), loads  # both workers have some
            victim.kill()
            # every request ends, the victim's moved to the survivor, within a bounded time
            await call.done_writing()

            async def drain():
                while (resp := await call.read()) != grpc.aio.EOF:
                    results[resp.event.request_id].add(resp.event)

            await asyncio.wait_for(drain(), timeout=60)
            code = await call.code()
            # new requests go to the survivor
            after = await run_stream(stub, [start(f"n{i}", max_tokens=4, temperature=0) for i in range(4)])
            single = [r async for r in stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", max_tokens=3)))]
            health_one_left = await _health(gateway.address)
            survivor.kill()
            await _wait_health(gateway.address, health_pb2.HealthCheckResponse.NOT_SERVING)
            none_left, none_left_msg = grpc.StatusCode.OK, "a request was served with no worker left"
            try:
                await stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", max_tokens=3)), timeout=10).read()
            except grpc.aio.AioRpcError as e:
                none_left, none_left_msg = e.code(), e.details() or ""
            return results, code, after, single, health_one_left, none_left, none_left_msg

    results, code, after, single, health_one_left, none_left, none_left_msg = asyncio.run(main())
    assert code == grpc.StatusCode.OK  # the stream itself stayed up
    assert all(
        r.finish_reason == pb.FINISH_REASON_LENGTH and len(r.token_ids) == LONG["max_tokens"] for r in results.values()
    )
    assert all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in after.values())
    assert single[-1].event.WhichOneof("kind") == "finished"
    assert health_one_left == health_pb2.HealthCheckResponse.SERVING
    assert none_left == grpc.StatusCode.UNAVAILABLE and "no healthy worker" in none_left_msg, (none_left, none_left_msg)
