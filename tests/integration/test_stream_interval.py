"""Answers read whole come in a few worker messages (``WorkerServiceGenerateRequest.stream_interval``).

A non-streamed HTTP request used to cost one worker message (and one gateway wake-up) per token,
about 10% of a 2-core machine's decode speed (docs/benchmarks.md). The gateway now asks the
worker to gather such a request's deltas, WHOLE_ANSWER_INTERVAL tokens at a time after the first;
the tokens, text and logprobs must be the same, the first delta must still go out at once (time
to first token), a cancelled request must free its blocks, and a worker killed mid-answer must
cost no token (the failover goes on from the last delta received).

Real worker processes of the embedded model, real gRPC and HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import grpc
import pytest

from draftwise.gateway.admit import Admitted
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.openai.server import WHOLE_ANSWER_INTERVAL
from draftwise.gateway.relay import Relay
from draftwise.gateway.server import Gateway
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from tests.integration.http_gateway import HttpGateway, http_gateway
from tests.integration.procs import ENGINE_ARGS, INTERNAL_SECRET, PARENT, Proc, all_ready, secret_args, start_gateway
from tests.integration.rpc import Result, run_stream, start, worker_metadata

PROMPT = "def fibonacci(n):"
N = 40


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory):
    with http_gateway(tmp_path_factory.mktemp("interval")) as s:
        yield s


async def _events(address: str, s: pb.StartGeneration, interval: int) -> list[pb.GenerationEvent]:
    async with grpc.aio.insecure_channel(address) as ch:
        req = wpb.WorkerServiceGenerateRequest(start=s, stream_interval=interval)
        call = wgrpc.WorkerServiceStub(ch).Generate(req, metadata=worker_metadata(), timeout=120)
        return [resp.event async for resp in call]


def _deltas(events: list[pb.GenerationEvent]) -> list[pb.TokenDelta]:
    assert events[-1].WhichOneof("kind") == "finished", events[-1]
    assert all(e.WhichOneof("kind") == "delta" for e in events[:-1])
    return [e.delta for e in events[:-1]]


def _logprobs(deltas: list[pb.TokenDelta]) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for d in deltas for lp in d.logprobs]


def test_the_worker_gathers_deltas_after_the_first(http: HttpGateway) -> None:
    params = {"temperature": 0, "max_tokens": N, "ignore_eos": True, "logprobs": 2}
    plain_events = asyncio.run(_events(http.worker.address, start("plain", PROMPT, **params), 0))
    gathered_events = asyncio.run(_events(http.worker.address, start("gathered", PROMPT, **params), 5))
    plain, gathered = _deltas(plain_events), _deltas(gathered_events)
    tokens = [t for d in plain for t in d.token_ids]
    assert len(tokens) == N
    assert [t for d in gathered for t in d.token_ids] == tokens
    assert "".join(d.text for d in gathered) == "".join(d.text for d in plain)
    assert _logprobs(gathered) == _logprobs(plain) and len(_logprobs(plain)) == N
    # the first delta as it came (with the prompt's size), then deltas of >= 5 tokens, then the rest
    assert list(gathered[0].token_ids) == list(plain[0].token_ids) and gathered[0].first_token_index == 0
    assert gathered[0].prompt_tokens == plain[0].prompt_tokens > 0
    assert all(len(d.token_ids) >= 5 for d in gathered[1:-1]), [len(d.token_ids) for d in gathered]
    assert len(gathered) <= 1 + math.ceil((N - len(gathered[0].token_ids)) / 5) < len(plain)
    starts = [d.first_token_index for d in gathered]
    assert starts == [sum(len(d.token_ids) for d in gathered[:i]) for i in range(len(gathered))]
    f_plain, f_gathered = plain_events[-1].finished, gathered_events[-1].finished
    assert f_gathered.finish_reason == f_plain.finish_reason == pb.FINISH_REASON_LENGTH
    assert f_gathered.usage == f_plain.usage


def test_a_continuation_sends_its_first_delta_at_once(http: HttpGateway) -> None:
    params = {"temperature": 0, "max_tokens": N, "ignore_eos": True}
    ref = [
        t
        for d in _deltas(asyncio.run(_events(http.worker.address, start("ref", PROMPT, **params), 0)))
        for t in d.token_ids
    ]
    s = start("cont", PROMPT, **params)
    s.continuation.output_token_ids.extend(ref[:7])
    deltas = _deltas(asyncio.run(_events(http.worker.address, s, 100)))
    assert deltas[0].first_token_index == 7
    assert len(deltas) == 2, [len(d.token_ids) for d in deltas]  # the first step's tokens, then the rest at the end
    assert [t for d in deltas for t in d.token_ids] == ref[7:]


def test_a_cancelled_gathered_request_frees_its_blocks(http: HttpGateway) -> None:
    async def go() -> tuple[int, int]:
        async with grpc.aio.insecure_channel(http.worker.address) as ch:
            stub = wgrpc.WorkerServiceStub(ch)
            s = start("cancelled", PROMPT, temperature=0, max_tokens=400, ignore_eos=True)
            call = stub.Generate(
                wpb.WorkerServiceGenerateRequest(start=s, stream_interval=64), metadata=worker_metadata(), timeout=120
            )
            first = await call.read()
            assert first.event.WhichOneof("kind") == "delta"
            call.cancel()
            deadline = time.monotonic() + 20
            while True:
                load = await stub.GetLoad(wpb.GetLoadRequest(), metadata=worker_metadata(), timeout=10)
                if load.num_free_kv_blocks == load.num_total_kv_blocks or time.monotonic() > deadline:
                    return load.num_free_kv_blocks, load.num_total_kv_blocks
                await asyncio.sleep(0.05)

    free, total = asyncio.run(go())
    assert free == total > 0
    # and the worker goes on serving
    after = _deltas(asyncio.run(_events(http.worker.address, start("after", PROMPT, temperature=0, max_tokens=4), 8)))
    assert sum(len(d.token_ids) for d in after) == 4


def _finished_line(http: HttpGateway, rid: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        for e in http.gateway.log_events():
            if e.get("event") == "request finished" and e.get("request_id") == rid:
                return e
        assert time.monotonic() < deadline, f"no 'request finished' line for {rid}"
        time.sleep(0.05)


def _sse_text(body: bytes) -> tuple[str, str]:
    """(the request id, the text) of a streamed /v1/completions answer."""
    rid, text = "", []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            text.append(chunk["choices"][0]["text"])
    return rid, "".join(text)


def test_a_non_streamed_http_answer_comes_in_a_few_worker_deltas(http: HttpGateway) -> None:
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    status, _, whole = http.post_json("/v1/completions", body)
    assert status == 200, whole
    assert isinstance(whole, dict) and whole["usage"]["completion_tokens"] == N
    status, _, raw = http.post("/v1/completions", json.dumps({**body, "stream": True}).encode())
    assert status == 200, raw
    streamed_id, streamed_text = _sse_text(raw)
    assert whole["choices"][0]["text"] == streamed_text
    few = _finished_line(http, whole["id"])["worker_deltas"]
    many = _finished_line(http, streamed_id)["worker_deltas"]
    assert few <= 1 + math.ceil((N - 1) / WHOLE_ANSWER_INTERVAL) < many, (few, many)


@pytest.fixture(scope="module")
def slow_pair(proc_dir: Path):
    """Two workers whose steps take 10 ms more than they would: a 300-token answer takes seconds."""
    script = Path(__file__).with_name("slow_worker.py")
    args = [str(script), "0.01", "--port=0", "--log-format=json", *PARENT, *secret_args(), *ENGINE_ARGS]
    procs = [Proc(f"interval-slow{i}", args, proc_dir) for i in range(2)]
    yield all_ready(procs)
    for p in procs:
        p.stop()


def test_a_worker_killed_mid_answer_costs_no_token(slow_pair: list[Proc]) -> None:
    n, interval = 300, 16
    params = {"temperature": 0, "max_tokens": n, "ignore_eos": True}
    ref_deltas = _deltas(asyncio.run(_events(slow_pair[0].address, start("ref", PROMPT, **params), 0)))
    ref = [t for d in ref_deltas for t in d.token_ids]
    assert len(ref) == n
    by_address = {p.address: p for p in slow_pair}

    async def go() -> tuple[list[pb.GenerationEvent], Relay, int]:
        workers = tuple(p.address for p in slow_pair)
        config = GatewayConfig(workers=workers, internal_secret=INTERNAL_SECRET, load_poll_interval_s=0.05)
        gw = Gateway(config)
        await gw.router.start()
        try:
            for _ in range(200):
                if len([w for w in gw.router.workers if w.healthy]) == 2:
                    break
                await asyncio.sleep(0.05)
            outbox = Outbox(1000)
            relay = Relay(gw.core, "whole", start("", PROMPT, **params), Admitted("draftwise-target"), outbox, 120.0)
            relay.request.stream_interval = interval
            assert gw.core.admission.try_acquire()
            task = relay.start()
            while relay.num_tokens < 1 + interval:  # the first delta and one gathered delta
                assert not task.done()
                await asyncio.sleep(0.005)
            killed_at = relay.num_tokens
            assert relay.worker is not None
            by_address[relay.worker.address].kill()
            await asyncio.wait_for(task, 120)
            events = []
            while len(outbox):
                events.append((await outbox.get()).event)
            return events, relay, killed_at
        finally:
            await gw.router.close()

    events, relay, killed_at = asyncio.run(go())
    assert killed_at < n and relay.failovers == 1, (killed_at, relay.failovers)
    assert events[-1].WhichOneof("kind") == "finished", events[-1]
    assert [t for e in events[:-1] for t in e.delta.token_ids] == ref


def test_the_gateways_stream_interval_gathers_streamed_deltas(http: HttpGateway, proc_dir: Path) -> None:
    """``--stream-interval 4`` (vLLM's and SGLang's flag): a streamed request's deltas after the first
    hold at least 4 tokens, on the Generate stream and over SSE; the tokens are the same."""
    gw = start_gateway([http.worker], proc_dir, "gw-interval", "--stream-interval=4")
    try:

        async def go(interval_gateway: bool) -> Result:
            address = gw.address if interval_gateway else http.gateway.address
            async with grpc.aio.insecure_channel(address) as ch:
                stub = gsgrpc.GenerateServiceStub(ch)
                rid = f"s{int(interval_gateway)}"
                got = await run_stream(stub, [start(rid, PROMPT, temperature=0, max_tokens=N, ignore_eos=True)])
            return got[rid]

        plain, gathered = asyncio.run(go(False)), asyncio.run(go(True))
    finally:
        gw.stop()
    assert gathered.token_ids == plain.token_ids and len(plain.token_ids) == N
    assert gathered.delta_sizes[0] == plain.delta_sizes[0]
    assert all(n >= 4 for n in gathered.delta_sizes[1:-1]), gathered.delta_sizes
    assert len(gathered.delta_sizes) < len(plain.delta_sizes), (gathered.delta_sizes, plain.delta_sizes)


def test_a_stream_interval_past_the_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_interval must be in"):
        GatewayConfig(stream_interval=0)
    with pytest.raises(ValueError, match=r"max_buffered_tokens=16\], got 17"):
        GatewayConfig(stream_interval=17, max_buffered_tokens=16)
