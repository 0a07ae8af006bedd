"""A request whose client went away holds no capacity (issue 23, defect 2). It is kept for a
resume for the retention time (the default, 60 s, here), but paused: its admission slot is
given back and its worker call cancelled (the worker frees its KV blocks) at once. A resume
re-admits it (RESOURCE_EXHAUSTED when every slot is taken, as for a new request), replays what
the client lacks and goes on as a continuation, token for token (greedy and seeded). An
explicit ``CancelGeneration`` aborts at once. Real worker and gateway processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import grpc
import pytest

from draftwise.gateway.admission import PUSHBACK_KEY
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import Proc, metrics_port, start_gateway, start_workers
from tests.integration.rpc import (
    Result,
    cancel_req,
    scrape_metrics,
    start,
    start_req,
    wait_workers_idle,
    worker_loads,
)

MAX_IN_FLIGHT = 16
N_TOKENS = 120
"""Tokens of each held request: far from done when its client goes away after the first delta."""
ADMITTED_WITHIN_S = 1.0
"""After the 16 cancels, the next request must be admitted within this (it waited out the
retention time, 60 s, before)."""


def _params(i: int) -> dict:
    """Even i: greedy; odd i: sampled with a seed (both must resume exactly)."""
    if i % 2:
        return {"max_tokens": N_TOKENS, "ignore_eos": True, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
    return {"max_tokens": N_TOKENS, "ignore_eos": True, "temperature": 0}


def _prompt(i: int) -> str:
    return f"# task {i}\ndef f{i}(x):"


@pytest.fixture(scope="module")
def held(proc_dir: Path):
    (worker,) = start_workers(1, proc_dir, prefix="paused")
    try:
        gateway = start_gateway([worker], proc_dir, "gateway-paused", f"--max-in-flight={MAX_IN_FLIGHT}")
    except BaseException:
        worker.kill()
        raise
    yield worker, gateway
    gateway.stop()
    worker.stop()


def _metric(gateway: Proc, name: str) -> float:
    return scrape_metrics(metrics_port(gateway)).get(name, 0.0)


async def _first_delta_then_cancel(stub, i: int) -> tuple[str, Result]:
    """A GenerateStream whose client cancels it right after its first delta: (handle, what it got)."""
    call = stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", _prompt(i), **_params(i))), timeout=120)
    got = Result(str(i))
    ev = (await call.read()).event
    got.add(ev)
    call.cancel()
    return ev.delta.resume_handle, got


async def _admitted_after(stub) -> tuple[float, Result, int]:
    """Seconds until a new request is admitted (retried every 10 ms while RESOURCE_EXHAUSTED,
    for 10 x ADMITTED_WITHIN_S at most), what it got, and how many refusals it saw."""
    t0 = time.monotonic()
    refused = 0
    while True:
        call = stub.GenerateStream(
            gspb.GenerateStreamRequest(start=start("", "def g():", max_tokens=4, temperature=0)), timeout=60
        )
        r = Result("new")
        try:
            first = await call.read()
            latency = time.monotonic() - t0
            r.add(first.event)
            while (resp := await call.read()) != grpc.aio.EOF:
                r.add(resp.event)
            return latency, r, refused
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            refused += 1
            waited = time.monotonic() - t0
            assert waited < 10 * ADMITTED_WITHIN_S, f"not admitted after {waited:.1f} s ({refused} refusals)"
            await asyncio.sleep(0.01)


async def _all_admitted(call, fillers: dict[str, Result]) -> None:
    """Read ``call`` until each of ``fillers`` has a token; AssertionError if one is refused."""
    while not all(r.token_ids for r in fillers.values()):
        ev = (await call.read()).event
        fillers[ev.request_id].add(ev)
        assert fillers[ev.request_id].kind != "error", f"a new request was refused: {ev.error.message}"


async def _resume(stub, handle: str, have: Result) -> Result:
    """Resume on GenerateStream from what ``have`` holds; the whole request's tokens."""
    rest = Result(have.request_id)
    rest.token_ids, rest.text = list(have.token_ids), have.text
    resume = gspb.ResumeGeneration(resume_handle=handle, next_token_index=len(have.token_ids))
    async for resp in stub.GenerateStream(gspb.GenerateStreamRequest(resume=resume), timeout=120):
        rest.add(resp.event)
    return rest


async def _undisturbed(stub, i: int) -> Result:
    r = Result(str(i))
    async for resp in stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", _prompt(i), **_params(i)))):
        r.add(resp.event)
    return r


def test_client_cancels_free_slots_and_compute_and_resume_re_admits(held):
    worker, gateway = held

    async def main():
        out: dict = {}
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            # 1. 16 clients go away after their first delta
            gone = await asyncio.gather(*(_first_delta_then_cancel(stub, i) for i in range(MAX_IN_FLIGHT)))
            # 2. the next request is admitted at once
            out["latency"], out["new"], out["refused"] = await _admitted_after(stub)
            # 3. the paused requests hold no worker compute
            out["idle_s"] = await wait_workers_idle([worker.address], timeout=30)
            out["detached"] = _metric(gateway, "draftwise_requests_detached")
            out["in_flight"] = _metric(gateway, "draftwise_requests_in_flight")
            # 4. every slot taken by new requests: a resume is refused like a new request
            fill = stub.Generate(timeout=120)
            fillers = {f"f{i}": Result(f"f{i}") for i in range(MAX_IN_FLIGHT)}
            for rid in fillers:
                await fill.write(start_req(start(rid, "import os\n", max_tokens=400, ignore_eos=True, temperature=0)))
            await _all_admitted(fill, fillers)
            handle0, have0 = gone[0]
            try:
                await _resume(stub, handle0, have0)
                out["full"] = (grpc.StatusCode.OK, {})
            except grpc.aio.AioRpcError as e:
                out["full"] = (e.code(), dict(e.trailing_metadata() or ()))
            # 5. explicit cancels abort the fillers at once (no pause)
            for rid in fillers:
                await fill.write(cancel_req(rid))
            await fill.done_writing()
            while (resp := await fill.read()) != grpc.aio.EOF:
                fillers[resp.event.request_id].add(resp.event)
            out["fillers"] = fillers
            out["fill_idle_s"] = await wait_workers_idle([worker.address], timeout=30)
            out["detached_after_fill"] = _metric(gateway, "draftwise_requests_detached")
            # 6. resumes (greedy and seeded) go on exactly
            out["resumed"] = await asyncio.gather(*(_resume(stub, h, have) for h, have in gone[:4]))
            out["reference"] = await asyncio.gather(*(_undisturbed(stub, i) for i in range(4)))
        return out

    out = asyncio.run(main())
    print(
        f"\nnext request admitted {out['latency'] * 1e3:.0f} ms after 16 client cancels "
        f"({out['refused']} refusals first); worker idle {out['idle_s'] * 1e3:.0f} ms later"
    )
    assert out["latency"] < ADMITTED_WITHIN_S, out["latency"]
    assert out["new"].kind == "finished" and len(out["new"].token_ids) == 4
    assert out["detached"] == MAX_IN_FLIGHT and out["in_flight"] == 0, (out["detached"], out["in_flight"])
    code, trailers = out["full"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and PUSHBACK_KEY in trailers, out["full"]
    for r in out["fillers"].values():
        assert r.finish_reason == pb.FINISH_REASON_ABORT and len(r.token_ids) < 400, r.final
    assert out["detached_after_fill"] == MAX_IN_FLIGHT  # the explicit cancels were not kept
    for got, ref in zip(out["resumed"], out["reference"], strict=True):
        assert ref.kind == "finished" and len(ref.token_ids) == N_TOKENS
        assert got.kind == "finished" and got.token_ids == ref.token_ids, got.request_id
        assert got.text == ref.text, got.request_id
        assert got.final.finished.usage.completion_tokens == N_TOKENS


def test_a_resume_on_the_multiplexed_stream_at_capacity_gets_the_retry_hint(held):
    """On ``Generate`` a refused resume is that request's error event, with retry_after_ms."""
    worker, gateway = held

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            handle, have = await _first_delta_then_cancel(stub, 0)
            fill = stub.Generate(timeout=120)
            fillers = {f"f{i}": Result(f"f{i}") for i in range(MAX_IN_FLIGHT)}
            for rid in fillers:
                await fill.write(start_req(start(rid, "import os\n", max_tokens=400, ignore_eos=True, temperature=0)))
            await _all_admitted(fill, fillers)
            resume = gspb.ResumeGeneration(
                resume_handle=handle, next_token_index=len(have.token_ids), request_id="again"
            )
            await fill.write(gspb.GenerateRequest(resume=resume))
            refused = None
            while refused is None:
                ev = (await fill.read()).event
                if ev.request_id == "again":
                    refused = ev
                else:
                    fillers[ev.request_id].add(ev)
            fill.cancel()  # the fillers are paused in turn; the first one can be resumed now
            await asyncio.sleep(0.2)
            rest = await _resume(stub, handle, have)
            await wait_workers_idle([worker.address], timeout=30)
            return refused, rest, await _undisturbed(stub, 0)

    refused, rest, ref = asyncio.run(main())
    assert refused.WhichOneof("kind") == "error", refused
    assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and refused.error.retry_after_ms > 0
    assert rest.token_ids == ref.token_ids and rest.text == ref.text


def _http_port(gateway: Proc) -> int:
    for event in gateway.log_events():
        if event.get("event") == "gateway listening":
            return int(event["http_port"])
    raise AssertionError("the gateway logged no 'gateway listening' line")


def _post(port: int, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST /v1/completions, its response not read."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_an_http_client_that_disconnects_cancels_its_request_at_once(held, proc_dir: Path):
    """The OpenAI endpoint has no resume: a client that leaves before its (non-streamed)
    response aborts the request, which frees the worker and the only admission slot."""
    worker, _ = held
    gateway = start_gateway([worker], proc_dir, "gateway-http-cut", "--http-port=0", "--max-in-flight=1")
    try:
        port = _http_port(gateway)
        asyncio.run(wait_workers_idle([worker.address], timeout=30))
        s = _post(port, {"model": "draftwise-target", "prompt": "import os\n", "max_tokens": 400, "ignore_eos": True})
        t0 = time.monotonic()
        while not asyncio.run(worker_loads([worker.address]))[0].num_requests_running:
            assert time.monotonic() - t0 < 30, "the request never ran"
            time.sleep(0.01)
        s.close()  # the client goes away
        idle_s = asyncio.run(wait_workers_idle([worker.address], timeout=30))
        m = scrape_metrics(metrics_port(gateway))
        with _post(port, {"model": "draftwise-target", "prompt": "def f():", "max_tokens": 2}) as s2:
            status = s2.recv(64).split(b" ")[1]  # the only slot is free again
    finally:
        gateway.stop()
    print(f"\nworker idle {idle_s * 1e3:.0f} ms after the HTTP client left")
    assert m.get('draftwise_requests_total{status="abort"}') == 1.0
    assert m["draftwise_generation_tokens_total"] < 400 and m["draftwise_requests_in_flight"] == 0
    assert status == b"200"
