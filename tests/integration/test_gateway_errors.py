"""The gateway's error paths, against real workers over 127.0.0.1 with raw gRPC clients:
malformed bytes on every RPC, one message-size limit checked at the gateway, bounded error
messages, the standard retry hint on RESOURCE_EXHAUSTED, the usage and timings of a final
ABORT, and engine errors counted per worker."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from draftwise.gateway.config import DEFAULT_MAX_REQUEST_BYTES
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import metrics_port, start_gateway, start_workers
from tests.integration.rpc import Result, cancel_req, scrape_metrics, start, start_req, wait_workers_idle

SERVICE = "/draftwise.v1.GenerateService/"
LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
OK = {"max_tokens": 4, "temperature": 0}


def _scrape(gateway) -> dict[str, float]:
    return scrape_metrics(metrics_port(gateway))


def _garbage(rng: random.Random, message_type: type, n: int) -> list[bytes]:
    """``n`` random byte strings that do not parse as ``message_type``."""
    out: list[bytes] = []
    while len(out) < n:
        data = rng.randbytes(rng.randint(1, 64))
        try:
            message_type.FromString(data)
        except DecodeError:
            out.append(data)
    return out


# ---------------------------------------------------------------------------- malformed bytes


def test_random_bytes_on_generate_end_the_call_with_invalid_argument(gateway, workers):
    """Defect 5: one undecodable message used to stop the gateway reading the call, which then
    hung until the client's deadline. Now the call ends with INVALID_ARGUMENT at once, its
    in-flight request is aborted (the worker frees its blocks), and each is counted."""
    blobs = _garbage(random.Random(5), gspb.GenerateRequest, 20)

    async def one(ch: grpc.aio.Channel, i: int, data: bytes) -> tuple[grpc.StatusCode, str, float]:
        call = ch.stream_stream(SERVICE + "Generate")(timeout=20)  # identity serializers: raw bytes
        await call.write(start_req(start(f"ok{i}", f"# {i}\nimport os", **LONG)).SerializeToString())
        first = gspb.GenerateResponse.FromString(await call.read())  # the request is running
        assert first.event.WhichOneof("kind") == "delta"
        t0 = time.perf_counter()
        await call.write(data)
        try:  # later messages (a cancel, the half-close) must not be what ends it
            await call.write(cancel_req(f"ok{i}").SerializeToString())
            await call.done_writing()
        except grpc.aio.UsageError:
            pass
        except grpc.aio.AioRpcError:
            pass
        try:
            while await call.read() != grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError:
            pass
        return await call.code(), await call.details(), time.perf_counter() - t0

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            return await asyncio.gather(*(one(ch, i, d) for i, d in enumerate(blobs)))

    before = _scrape(gateway)
    outcomes = asyncio.run(main())
    after = _scrape(gateway)
    for code, details, seconds in outcomes:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "malformed message" in details and "GenerateRequest" in details
        assert seconds < 60, seconds  # ended by the gateway, not left hanging (a liveness bound, not a speed one)
    key = 'draftwise_requests_total{status="invalid_argument"}'
    assert after.get(key, 0) - before.get(key, 0) >= len(blobs)
    lines = [e for e in gateway.log_events() if e.get("event") == "malformed message; ending the call"]
    assert len(lines) >= len(blobs)
    asyncio.run(wait_workers_idle([w.address for w in workers], timeout=30))  # the aborted requests freed all


@pytest.mark.parametrize("method", ["GenerateStream", "ListModels"])
def test_random_bytes_on_unary_request_rpcs_are_invalid_argument(gateway, method):
    message_type = gspb.GenerateStreamRequest if method == "GenerateStream" else gspb.ListModelsRequest
    blobs = _garbage(random.Random(7), message_type, 10)

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            out = []
            for data in blobs:
                rpc = (ch.unary_stream if method == "GenerateStream" else ch.unary_unary)(SERVICE + method)
                call = rpc(data, timeout=10)
                try:
                    if method == "GenerateStream":
                        async for _ in call:
                            pass
                    else:
                        await call
                    out.append((grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
            return out

    for code, details in asyncio.run(main()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed message" in details, (code, details)


def test_random_bytes_on_health_and_reflection_are_invalid_argument(gateway):
    """The services gRPC provides answered UNKNOWN ("Unexpected DecodeError") before."""

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            out = []
            try:
                await ch.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff\xff", timeout=10)
                out.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                out.append(e.code())
            try:
                async for _ in ch.unary_stream("/grpc.health.v1.Health/Watch")(b"\xff\xff\xff", timeout=10):
                    pass
                out.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                out.append(e.code())
            call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(timeout=10)
            await call.write(b"\xff\xff\xff")
            try:
                await call.done_writing()
                while await call.read() != grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError:
                pass
            out.append(await call.code())
            return out

    assert asyncio.run(main()) == [grpc.StatusCode.INVALID_ARGUMENT] * 3


# ---------------------------------------------------------------------------- one size limit


def _huge_start(rid: str, size: int) -> pb.StartGeneration:
    return start(rid, "x" * size, **OK)


def test_a_request_over_the_limit_is_invalid_argument_naming_the_limit(gateway, workers):
    """Defect 8: a 5 MB request got the internal hop's RESOURCE_EXHAUSTED; the gateway's own
    limit answers first, with INVALID_ARGUMENT naming it. On the Generate stream it is that
    request's error; the stream goes on."""

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            try:
                await stub.GenerateStream(
                    gspb.GenerateStreamRequest(start=_huge_start("", 5_000_000)), timeout=30
                ).read()
                single = (grpc.StatusCode.OK, "")
            except grpc.aio.AioRpcError as e:
                single = (e.code(), e.details())
            call = stub.Generate(timeout=60)
            await call.write(start_req(_huge_start("big", 5_000_000)))
            await call.write(start_req(start("after", **OK)))
            await call.done_writing()
            results: dict[str, Result] = {}
            async for resp in call:
                results.setdefault(resp.event.request_id, Result(resp.event.request_id)).add(resp.event)
            return single, results, await call.code()

    single, results, code = asyncio.run(main())
    limit = str(DEFAULT_MAX_REQUEST_BYTES)
    assert single[0] == grpc.StatusCode.INVALID_ARGUMENT and limit in single[1], single
    assert code == grpc.StatusCode.OK
    assert results["big"].code == grpc.StatusCode.INVALID_ARGUMENT and limit in results["big"].final.error.message
    assert results["after"].finish_reason == pb.FINISH_REASON_LENGTH


def test_error_messages_do_not_echo_unbounded_client_input(gateway):
    """A 1 MiB model name made the error larger than the client's metadata limit."""
    name = "m" * (1 << 20)

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            try:
                await stub.GenerateStream(
                    gspb.GenerateStreamRequest(start=start("", model=name, **OK)), timeout=30
                ).read()
                single = (grpc.StatusCode.OK, "")
            except grpc.aio.AioRpcError as e:
                single = (e.code(), e.details())
            call = stub.Generate(timeout=30)
            rid = "r" * 100_000
            await call.write(start_req(start(rid, **LONG)))
            await call.write(start_req(start(rid, **LONG)))  # a duplicate id: its error quotes the id
            await call.write(start_req(start("m", model=name, **OK)))
            await call.write(cancel_req(rid))
            await call.done_writing()
            events = [resp.event async for resp in call]
            return single, events

    single, events = asyncio.run(main())
    assert single[0] == grpc.StatusCode.INVALID_ARGUMENT and "unknown model" in single[1], single[0]
    assert len(single[1]) < 500, len(single[1])
    errors = [e.error for e in events if e.WhichOneof("kind") == "error"]
    assert len(errors) == 2 and all(e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for e in errors)
    assert all(len(e.message) < 500 for e in errors), [len(e.message) for e in errors]
    assert "already in flight" in errors[0].message and "unknown model" in errors[1].message


# ---------------------------------------------------------------------------- overload signals


@pytest.fixture(scope="module")
def one_slot_gateway(workers, proc_dir):
    g = start_gateway(workers, proc_dir, "gateway-one-slot", "--max-in-flight=1", "--retry-after-ms=321")
    yield g
    g.stop()


def test_resource_exhausted_carries_the_standard_retry_hint(one_slot_gateway, workers):
    async def main():
        async with grpc.aio.insecure_channel(one_slot_gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.Generate(timeout=60)
            await call.write(start_req(start("hold", **LONG)))
            first = await call.read()  # the slot is taken
            await call.write(start_req(start("over", **OK)))
            over = None
            while over is None:
                ev = (await call.read()).event
                if ev.request_id == "over":
                    over = ev
            single = stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", **OK)), timeout=30)
            try:
                await single.read()
                err = None
            except grpc.aio.AioRpcError as e:
                err = e
            await call.write(cancel_req("hold"))
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass
            return first, over, err

    first, over, err = asyncio.run(main())
    assert first.event.WhichOneof("kind") == "delta"
    assert over.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and over.error.retry_after_ms == 321
    assert "retry after 321 ms" in over.error.message
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(err.trailing_metadata())
    assert trailing["grpc-retry-pushback-ms"] == "321" and trailing["retry-after-ms"] == "321"
    status = rpc_status.from_call(err)
    assert status is not None and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    infos = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = error_details_pb2.RetryInfo()
    infos[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() == 321


# ---------------------------------------------------------------------------- ABORT usage and timings


@pytest.mark.parametrize("kind", ["token_ids", "text"])
def test_a_cancelled_requests_abort_reports_prompt_tokens_and_timings(gateway, workers, kind):
    """Defect 9: the ABORT event the gateway builds said prompt_tokens = 0, no timings, and
    the prompt-token metric never counted it."""
    from draftwise.worker import default_model_path
    from draftwise.worker.text.tokenizer import load_tokenizer

    text = "def cancelled(request):\n    return request.prompt_tokens  # counted\n"
    prompt = list(range(100, 137)) if kind == "token_ids" else text
    ids = prompt if kind == "token_ids" else load_tokenizer(default_model_path("target")).encode(text)

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=60)
            await call.write(start_req(start("c", prompt, **LONG)))
            r = Result("c")
            while len(r.token_ids) < 3:
                r.add((await call.read()).event)
            await call.write(cancel_req("c"))
            await call.done_writing()
            while (resp := await call.read()) != grpc.aio.EOF:
                r.add(resp.event)
            return r

    asyncio.run(wait_workers_idle([w.address for w in workers], timeout=30))
    before = _scrape(gateway)
    r = asyncio.run(main())
    after = _scrape(gateway)
    assert r.finish_reason == pb.FINISH_REASON_ABORT
    f = r.final.finished
    assert f.usage.prompt_tokens == len(ids) and f.usage.completion_tokens == len(r.token_ids)
    assert 0 < f.timings.time_to_first_token_ms <= f.timings.total_ms
    assert f.timings.queue_ms > 0
    assert after["draftwise_prompt_tokens_total"] - before["draftwise_prompt_tokens_total"] == len(ids)


def test_default_buffered_token_bound_can_trigger_on_the_embedded_model():
    """With 2048 (the embedded model's whole context) the bound could never be reached."""
    import json

    from draftwise.gateway.config import GatewayConfig
    from tests.integration.procs import ROOT

    config = json.loads((ROOT / "worker" / "default_models" / "target" / "config.json").read_text())
    assert GatewayConfig().max_buffered_tokens < config["max_position_embeddings"]


# ---------------------------------------------------------------------------- engine errors


def test_a_worker_dying_mid_request_counts_an_engine_error(proc_dir):
    (victim,) = start_workers(1, proc_dir, prefix="engine-error")
    try:
        gw = start_gateway([victim], proc_dir, "gateway-engine-error")
    except BaseException:
        victim.kill()
        raise
    try:

        async def main():
            async with grpc.aio.insecure_channel(gw.address) as ch:
                call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=60)
                await call.write(start_req(start("a", **LONG)))
                r = Result("a")
                while len(r.token_ids) < 2:
                    r.add((await call.read()).event)
                victim.kill()
                await call.done_writing()
                while (resp := await call.read()) != grpc.aio.EOF:
                    r.add(resp.event)
                return r

        r = asyncio.run(main())
        metrics = _scrape(gw)
    finally:
        gw.stop()
        victim.kill()
    assert r.code == grpc.StatusCode.UNAVAILABLE
    assert metrics[f'draftwise_worker_engine_errors_total{{worker="{victim.address}"}}'] == 1
