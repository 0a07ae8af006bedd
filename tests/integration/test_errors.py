"""Each invalid request ends with INVALID_ARGUMENT (an error event on the multiplexed
stream, the call status on GenerateStream) while its stream and the server go on; the
admission limit answers RESOURCE_EXHAUSTED with a retry hint."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import MAX_MODEL_LEN, start_gateway
from tests.integration.rpc import Result, cancel_req, start, start_req

OK = {"max_tokens": 4, "temperature": 0}
DUP_TOKENS = 450
"""The long request whose id gets reused: still running when the duplicate arrives."""

# (id, StartGeneration, words the message must contain)
BAD_PARAMS = [
    ("temperature", {"temperature": -1.0}, "temperature"),
    ("temperature-nan", {"temperature": math.nan}, "temperature"),
    ("top_p-zero", {"top_p": 0.0}, "top_p"),
    ("top_p-big", {"top_p": 1.5}, "top_p"),
    ("top_k", {"top_k": -2}, "top_k"),
    ("min_p", {"min_p": 1.5}, "min_p"),
    ("max_tokens", {"max_tokens": 0}, "max_tokens"),
    ("min_tokens", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("stop", {"stop": [""]}, "stop"),
    ("presence_penalty", {"presence_penalty": 3.0}, "presence_penalty"),
    ("frequency_penalty", {"frequency_penalty": -3.0}, "frequency_penalty"),
    ("repetition_penalty", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("logprobs", {"logprobs": 21}, "logprobs"),
]


def bad_requests() -> list[tuple[str, pb.StartGeneration, str]]:
    out = [(name, start(name, **params), word) for name, params, word in BAD_PARAMS]
    out.append(("model", start("model", model="no-such-model", **OK), "unknown model"))
    out.append(("prompt-unset", pb.StartGeneration(request_id="prompt-unset"), "prompt"))
    out.append(("prompt-empty-text", start("prompt-empty-text", "", **OK), "prompt"))
    out.append(("prompt-empty-ids", start("prompt-empty-ids", [], **OK), "prompt"))
    out.append(("prompt-bad-id", start("prompt-bad-id", [1, 10**6], **OK), "token ids"))
    out.append(("long-ids", start("long-ids", [5] * (MAX_MODEL_LEN + 50), **OK), "shorter than"))
    out.append(("long-text", start("long-text", "x = 1\n" * MAX_MODEL_LEN, **OK), "shorter than"))
    return out


def test_invalid_requests_on_one_stream(gateway):
    bad = bad_requests()

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
            results: dict[str, Result] = {}
            original = Result("dup")  # the long request whose id gets reused
            rejected: list[pb.GenerationEvent] = []

            async def read_one() -> None:
                ev = (await call.read()).event
                if ev.request_id == "dup":
                    if ev.WhichOneof("kind") == "error":
                        rejected.append(ev)
                    else:
                        original.add(ev)
                else:
                    results.setdefault(ev.request_id, Result(ev.request_id)).add(ev)

            async def until_final(rid: str) -> Result:
                while rid not in results or results[rid].final is None:
                    await read_one()
                return results.pop(rid)

            out = {}
            # a long request stays in flight across all the bad ones
            await call.write(start_req(start("dup", max_tokens=DUP_TOKENS, ignore_eos=True, temperature=0)))
            while not original.token_ids:
                await read_one()
            # a duplicate id while it surely runs: rejected, the running request with that id goes on
            await call.write(start_req(start("dup", **OK)))
            while not rejected:
                await read_one()
            n_before = len(original.token_ids)
            while len(original.token_ids) < n_before + 3 and original.final is None:
                await read_one()
            out["dup-went-on"] = len(original.token_ids) - n_before
            for name, s, _ in bad:
                await call.write(start_req(s))
                out[name] = await until_final(name)
                await call.write(start_req(start(f"ok-{name}", **OK)))  # the stream still works
                out[f"ok-{name}"] = await until_final(f"ok-{name}")
            await call.write(start_req(start("", **OK)))
            out["empty-id"] = await until_final("")
            await call.write(cancel_req("dup"))  # ignored if it has already finished
            while original.final is None:
                await read_one()
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            out["dup-rejected"] = rejected
            out["dup-original"] = original
            return out, await call.code()

    out, code = asyncio.run(main())
    assert code == grpc.StatusCode.OK
    for name, _, word in bad:
        r = out[name]
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT, (name, r.final)
        assert word in r.final.error.message, (name, r.final.error.message)
        assert out[f"ok-{name}"].finish_reason == pb.FINISH_REASON_LENGTH
    assert out["empty-id"].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in out["empty-id"].final.error.message
    (rejected,) = out["dup-rejected"]
    assert rejected.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already in flight" in rejected.error.message
    assert out["dup-went-on"] >= 3  # it streamed on after the duplicate was rejected
    original = out["dup-original"]
    # it kept running until cancelled, or (on a fast machine) to its length, never an error
    assert original.finish_reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_LENGTH), original.final
    if original.finish_reason == pb.FINISH_REASON_LENGTH:
        assert len(original.token_ids) == DUP_TOKENS
    assert len(original.token_ids) == original.final.finished.usage.completion_tokens


@pytest.mark.parametrize("name", ["temperature", "model", "prompt-unset", "long-ids", "logprobs"])
def test_invalid_generate_stream_is_the_call_status(gateway, name):
    s = next(s for n, s, _ in bad_requests() if n == name)

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).GenerateStream(gspb.GenerateStreamRequest(start=s), timeout=30)
            events = []
            try:
                async for r in call:
                    events.append(r)
            except grpc.aio.AioRpcError as e:
                return events, e.code(), e.details()
            return events, grpc.StatusCode.OK, ""

    events, code, details = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and not events and details


@pytest.fixture(scope="module")
def small_gateway(workers, proc_dir):
    g = start_gateway(workers, proc_dir, "gateway-admission", "--max-in-flight=2", "--retry-after-ms=123")
    yield g
    g.stop()


def test_admission_limit_answers_resource_exhausted(small_gateway):
    async def main():
        async with grpc.aio.insecure_channel(small_gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.Generate(timeout=60)
            for rid in ("a", "b", "c"):
                await call.write(start_req(start(rid, max_tokens=300, ignore_eos=True, temperature=0)))
            results: dict[str, Result] = {}
            while "c" not in results or results["c"].final is None:
                ev = (await call.read()).event
                results.setdefault(ev.request_id, Result(ev.request_id)).add(ev)
            try:
                await stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", **OK)), timeout=30).read()
                stream_error = None
            except grpc.aio.AioRpcError as e:
                stream_error = e
            for rid in ("a", "b"):
                await call.write(cancel_req(rid))
            while any(results.get(r) is None or results[r].final is None for r in ("a", "b")):
                ev = (await call.read()).event
                results.setdefault(ev.request_id, Result(ev.request_id)).add(ev)
            # slots are free again
            await call.write(start_req(start("d", **OK)))
            results["d"] = Result("d")
            while results["d"].final is None:
                results["d"].add((await call.read()).event)
            await call.done_writing()
            return results, stream_error

    results, stream_error = asyncio.run(main())
    c = results["c"]
    assert c.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after 123 ms" in c.final.error.message
    assert stream_error is not None and stream_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", "123") in tuple(stream_error.trailing_metadata())
    assert results["a"].finish_reason == pb.FINISH_REASON_ABORT
    assert results["d"].finish_reason == pb.FINISH_REASON_LENGTH
