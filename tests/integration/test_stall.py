"""A busy worker is not a dead one (issue 23, defect 1). The gateway judges a hang on the
worker (does it answer its load polls?), never on one request's silence, and never takes the
last healthy worker out of rotation.

- A worker whose every engine step takes longer than ``--failover-stall-s`` (slept on purpose
  on the engine thread, ``tests/integration/slow_worker.py``; its gRPC front answers as usual):
  its streams all finish, a new request is admitted and served, the worker is never marked
  down and nothing fails over.
- A worker that hangs for real (SIGSTOP) before and after the first token of its requests: they
  go on on the other worker, exactly as the undisturbed run.
- The last worker hangs for a while (SIGSTOP, then SIGCONT): its stream waits on its call and
  finishes exactly; a request sent meanwhile is not refused.

Real processes on 127.0.0.1; the gateways poll every 0.5 s (GetLoad deadline 2 s)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker import SamplingParams
from tests.integration.conftest import reference_outputs
from tests.integration.procs import (
    ENGINE_ARGS,
    PARENT,
    Proc,
    metrics_port,
    secret_args,
    start_gateway,
    start_workers,
)
from tests.integration.rpc import Result, scrape_metrics, start, start_req, wait_workers_idle, worker_loads

STALL_S = 1.0
"""The gateways' --failover-stall-s: far below a slow worker's step."""
STEP_DELAY_S = 2.5
"""How long every step of the slow worker sleeps before it runs (longer than STALL_S)."""
N_TOKENS = 24
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "def quicksort(items):", "import os\n"]
GREEDY = {"max_tokens": N_TOKENS, "ignore_eos": True, "temperature": 0}
HUNG_DEADLINE_S = 12.0
"""Deadline of the requests sent to a worker that is already stopped: detection (a missed
GetLoad poll, 2.5 s at most, then STALL_S) and the run elsewhere fit well inside it; a gateway
that does not notice a hang before the first token leaves them waiting past it."""


@pytest.fixture(scope="module")
def slow(proc_dir: Path):
    script = Path(__file__).with_name("slow_worker.py")
    args = [str(script), str(STEP_DELAY_S), "--port=0", "--log-format=json", *PARENT, *secret_args(), *ENGINE_ARGS]
    worker = Proc("slow-worker", args, proc_dir).wait_ready()
    try:
        gateway = start_gateway([worker], proc_dir, "gateway-slow", f"--failover-stall-s={STALL_S:g}")
    except BaseException:
        worker.kill()
        raise
    yield worker, gateway
    gateway.stop()
    worker.stop()


@pytest.fixture(scope="module")
def pair(proc_dir: Path):
    """Two workers behind one gateway, and a second gateway in front of the second worker alone."""
    workers = start_workers(2, proc_dir, prefix="stall")
    gateways = []
    try:
        flags = (f"--failover-stall-s={STALL_S:g}", "--failover-wait-s=10")
        gateways.append(start_gateway(workers, proc_dir, "gateway-stall", *flags))
        gateways.append(start_gateway(workers[1:], proc_dir, "gateway-stall-one", *flags))
    except BaseException:
        for p in workers + gateways:
            p.kill()
        raise
    yield workers, gateways[0], gateways[1]
    for p in gateways + workers:
        p.kill()


@pytest.fixture(scope="module")
def reference(reference_llm):
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = reference_outputs(reference_llm, PROMPTS, params)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


def _downs(gateway: Proc) -> list[dict]:
    """The gateway's "worker down" log lines after start-up (a worker not polled yet aside)."""
    return [e for e in gateway.log_events() if e.get("event") == "worker down" and e.get("reason") != "not polled yet"]


def _failovers(gateway: Proc) -> float:
    m = scrape_metrics(metrics_port(gateway))
    return sum(v for k, v in m.items() if k.startswith("draftwise_failovers_total"))


async def _one(stub, prompt: str, params: dict, timeout: float) -> Result:
    """One GenerateStream request; a failed call's status ends up in ``final`` as an error."""
    r = Result(prompt)
    try:
        async for resp in stub.GenerateStream(
            gspb.GenerateStreamRequest(start=start("", prompt, **params)), timeout=timeout
        ):
            r.add(resp.event)
    except grpc.aio.AioRpcError as e:
        r.final = pb.GenerationEvent(error=pb.RequestError(code=e.code().value[0], message=e.details() or ""))
    return r


def test_a_slow_worker_is_not_a_hung_one(slow):
    """Every step takes STEP_DELAY_S > --failover-stall-s, on the gateway's only worker."""
    worker, gateway = slow
    params = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    healthy_key = f'draftwise_worker_healthy{{worker="{worker.address}"}}'

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.Generate(timeout=120)
            flowing = {p: Result(p) for p in PROMPTS[:2]}
            for p in flowing:
                await call.write(start_req(start(p, p, **params)))
            while not all(r.token_ids for r in flowing.values()):  # tokens went out, then a long step
                ev = (await call.read()).event
                flowing[ev.request_id].add(ev)
            health = []

            async def watch_health():
                while True:
                    health.append(scrape_metrics(metrics_port(gateway)).get(healthy_key))
                    await asyncio.sleep(0.25)

            watcher = asyncio.create_task(watch_health())
            # new requests while the worker is busy with its long steps: admitted and served
            later = asyncio.gather(*(_one(stub, p, params, 120) for p in PROMPTS[2:]))
            await call.done_writing()
            while (resp := await call.read()) != grpc.aio.EOF:
                flowing[resp.event.request_id].add(resp.event)
            news = await later
            watcher.cancel()
            return flowing, news, health

    t0 = time.monotonic()
    flowing, news, health = asyncio.run(main())
    took = time.monotonic() - t0
    for r in [*flowing.values(), *news]:
        assert r.kind == "finished" and len(r.token_ids) == 3, (r.request_id, r.final)
    assert health and set(health) == {1.0}, health  # never marked down
    assert not _downs(gateway)
    assert _failovers(gateway) == 0
    print(f"\nslow worker ({STEP_DELAY_S} s a step, stall threshold {STALL_S} s): 4 streams served in {took:.1f} s")


async def _busy_worker(workers):
    loads = await worker_loads([w.address for w in workers])
    return next(w for w, lo in zip(workers, loads, strict=True) if lo.num_requests_running)


def test_a_worker_that_hangs_after_the_first_token_is_left(pair, reference):
    workers, gateway, _ = pair
    stopped = []

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
            results = {p: Result(p) for p in PROMPTS}
            for p in PROMPTS:
                await call.write(start_req(start(p, p, **GREEDY)))
            while not all(len(r.token_ids) >= 2 for r in results.values()):
                ev = (await call.read()).event
                results[ev.request_id].add(ev)
            w = await _busy_worker(workers)
            os.kill(w.popen.pid, signal.SIGSTOP)
            stopped.append(w)
            await call.done_writing()
            while (resp := await call.read()) != grpc.aio.EOF:
                results[resp.event.request_id].add(resp.event)
            return results

    before = _failovers(gateway)
    try:
        results = asyncio.run(main())
    finally:
        for w in stopped:
            os.kill(w.popen.pid, signal.SIGCONT)
    for p, r in results.items():
        assert r.kind == "finished" and r.token_ids == reference[p], (p, r.final)
    assert _failovers(gateway) > before
    asyncio.run(wait_workers_idle([w.address for w in workers], timeout=30))
    _wait_healthy(gateway, workers)


def _wait_healthy(gateway: Proc, workers: list[Proc], timeout: float = 30.0) -> None:
    keys = [f'draftwise_worker_healthy{{worker="{w.address}"}}' for w in workers]
    t0 = time.monotonic()
    while not all(scrape_metrics(metrics_port(gateway)).get(k) == 1.0 for k in keys):
        assert time.monotonic() - t0 < timeout, "a worker did not come back into rotation"
        time.sleep(0.1)


def test_a_worker_that_hangs_before_the_first_token_is_left(pair, reference):
    """The worker is stopped first; the requests sent right after (while the gateway still
    counts it healthy: round robin puts half of them on it) get no token there."""
    workers, gateway, _ = pair
    victim = workers[0]
    _wait_healthy(gateway, workers)

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            return await asyncio.gather(*(_one(stub, p, GREEDY, HUNG_DEADLINE_S) for p in PROMPTS))

    os.kill(victim.popen.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        results = asyncio.run(main())
        took = time.monotonic() - t0
    finally:
        os.kill(victim.popen.pid, signal.SIGCONT)
    for p, r in zip(PROMPTS, results, strict=True):
        assert r.kind == "finished" and r.token_ids == reference[p], (p, r.final)
    moved = [
        e for e in gateway.log_events() if e.get("event") == "retrying on another worker" and e.get("reason") == "stall"
    ]
    assert moved, "no request was sent to the stopped worker: the test proved nothing"
    print(f"\n{len(moved)} requests moved off the stopped worker before their first token; all done in {took:.1f} s")
    asyncio.run(wait_workers_idle([w.address for w in workers], timeout=30))
    _wait_healthy(gateway, workers)


def test_the_last_worker_is_waited_for(pair, reference):
    """Behind a gateway with one worker, that worker stops for a few seconds (longer than the
    stall threshold, shorter than the missed polls that take a worker out among others)."""
    workers, _, gateway = pair
    (w,) = workers[1:]
    prompt = PROMPTS[1]

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.GenerateStream(gspb.GenerateStreamRequest(start=start("", prompt, **GREEDY)), timeout=60)
            got = Result("x")
            while len(got.token_ids) < 2:
                got.add((await call.read()).event)
            os.kill(w.popen.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(STALL_S + 1.0)
                new = asyncio.create_task(_one(stub, PROMPTS[0], GREEDY, 60))  # sent while it is stopped
                await asyncio.sleep(2.0)
            finally:
                os.kill(w.popen.pid, signal.SIGCONT)
            while (resp := await call.read()) != grpc.aio.EOF:
                got.add(resp.event)
            return got, await new

    before = _failovers(gateway)
    got, new = asyncio.run(main())
    assert got.kind == "finished" and got.token_ids == reference[prompt], got.final
    assert new.kind == "finished" and new.token_ids == reference[PROMPTS[0]], new.final
    assert _failovers(gateway) == before
    assert not _downs(gateway)
