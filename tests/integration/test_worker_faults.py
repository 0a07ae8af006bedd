"""A worker process under the traffic that used to kill it (issue 10): calls with deadlines
of a few milliseconds next to running streams, a mixed greedy + sampled batch under draft
speculation, a multi-megabyte text prompt. Real worker processes, real gRPC on 127.0.0.1:
afterwards the same processes serve and hold no KV block."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import grpc
import pytest

from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from tests.integration.procs import ENGINE_ARGS, PARENT, Proc, all_ready, secret_args
from tests.integration.rpc import start, wait_workers_idle, worker_metadata

LONG = {"max_tokens": 120, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def fault_workers(proc_dir):
    base = [
        "-m",
        "draftwise.worker.serving.server",
        "--port=0",
        "--log-format=json",
        *PARENT,
        *secret_args(),
        *ENGINE_ARGS,
    ]
    procs = [
        Proc("fault-plain", base, proc_dir),
        Proc("fault-spec", [*base, "--speculative-model=default", "--no-speculative-adaptive"], proc_dir),
    ]
    yield all_ready(procs)
    for p in procs:
        p.stop()


async def _generate(
    stub, s, timeout: float | None = 120.0, times: list[float] | None = None
) -> tuple[grpc.StatusCode, list[int], str]:
    """Run one worker Generate call: (status, output token ids, details); ``times`` gets the
    arrival time of each delta."""
    toks: list[int] = []
    call = stub.Generate(
        wpb.WorkerServiceGenerateRequest(start=s),
        timeout=timeout,
        metadata=worker_metadata(),
    )
    try:
        async for resp in call:
            if resp.event.WhichOneof("kind") == "delta":
                assert resp.event.delta.first_token_index == len(toks)
                toks.extend(resp.event.delta.token_ids)
                if times is not None:
                    times.append(time.perf_counter())
    except grpc.aio.AioRpcError as e:
        return e.code(), toks, e.details() or ""
    return grpc.StatusCode.OK, toks, ""


RST_STREAM = "INTERNAL_RST_STREAM"
"""What a call with a very short deadline may end with instead of DEADLINE_EXCEEDED: the
server's deadline fired first and reset the HTTP/2 stream, which the client's gRPC core
reports as INTERNAL "Internal error from Core" (as in tests/reliability/conftest.py)."""


def _outcome(code: grpc.StatusCode, details: str) -> str:
    """The name of a call's status; RST_STREAM for the transport's deadline race."""
    if code == grpc.StatusCode.INTERNAL and details == "Internal error from Core":
        return RST_STREAM
    return code.name


def _alive(p: Proc) -> bool:
    return p.popen.poll() is None


def test_millisecond_deadlines_next_to_running_streams(fault_workers):
    """Defect 2 over gRPC: GenerateStream calls with 5-30 ms deadlines while other requests ran
    killed the engine thread; every stream then ended UNAVAILABLE. Now each short call ends
    DEADLINE_EXCEEDED or OK (or the transport's reset, when the server's deadline wins the
    race), the running streams complete, and the same process serves the next request."""

    async def main(w: Proc):
        rng = random.Random(2)
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = wgrpc.WorkerServiceStub(ch)
            long = [asyncio.create_task(_generate(stub, start(f"long{i}", f"def f{i}(x):", **LONG))) for i in range(3)]
            await asyncio.sleep(0.3)
            short = []
            for i in range(80):
                params = {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0.0, 1.0]), "seed": i}
                s = start(f"dl{i}", "# " + "x" * rng.randint(1, 300), **params)
                short.append(asyncio.create_task(_generate(stub, s, timeout=rng.uniform(0.005, 0.03))))
                await asyncio.sleep(rng.uniform(0, 0.01))
            short_results = await asyncio.gather(*short)
            long_results = await asyncio.gather(*long)
            after = await _generate(stub, start("after", **{**LONG, "max_tokens": 8}))
        return short_results, long_results, after

    for w in fault_workers:
        pid = w.popen.pid
        short, long, after = asyncio.run(main(w))
        outcomes = [_outcome(c, d) for c, _, d in short]
        print(f"{w.name}: millisecond-deadline outcomes {dict(Counter(outcomes))}")
        assert set(outcomes) <= {"DEADLINE_EXCEEDED", "OK", RST_STREAM}, short
        assert "DEADLINE_EXCEEDED" in outcomes or RST_STREAM in outcomes  # some deadlines struck
        assert all(c == grpc.StatusCode.OK and len(t) == LONG["max_tokens"] for c, t, _ in long), long
        assert after[0] == grpc.StatusCode.OK and len(after[1]) == 8
        assert _alive(w) and w.popen.pid == pid
        asyncio.run(wait_workers_idle([w.address], timeout=30))


def test_mixed_greedy_and_sampled_under_draft_speculation(fault_workers):
    """Defect 1 over gRPC: the draft proposer's assertion killed the engine loop and the
    worker exited 1."""
    w = fault_workers[1]

    async def main():
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = wgrpc.WorkerServiceStub(ch)
            calls = [
                _generate(stub, start("greedy", "def fibonacci(n):", max_tokens=64, ignore_eos=True, temperature=0)),
                _generate(stub, start("sampled", "import os\n", max_tokens=4, ignore_eos=True, temperature=1.0)),
            ]
            calls += [
                _generate(stub, start(f"mix{i}", f"class C{i}:", max_tokens=3 + i, ignore_eos=True, temperature=i % 2))
                for i in range(6)
            ]
            return await asyncio.gather(*calls)

    results = asyncio.run(main())
    assert all(c == grpc.StatusCode.OK for c, _, _ in results), results
    assert len(results[0][1]) == 64 and len(results[1][1]) == 4
    assert _alive(w)
    asyncio.run(wait_workers_idle([w.address], timeout=30))


def test_a_multi_megabyte_prompt_is_refused_without_stalling_the_worker(fault_workers):
    """Defect 6: a 3.9 MB prompt was tokenized on the engine thread, freezing every other
    stream on the worker for 23 s before INVALID_ARGUMENT."""
    w = fault_workers[0]

    async def main():
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = wgrpc.WorkerServiceStub(ch)
            times: list[float] = []
            long = asyncio.create_task(_generate(stub, start("long", "def f(x):", **LONG), times=times))
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            huge = await _generate(stub, start("huge", "x = 1\n" * 650_000, max_tokens=4))
            t1 = time.perf_counter()
            result = await long
            around = [t for t in times if t0 - 0.5 <= t <= t1 + 0.5]
            gap = max((b - a for a, b in zip(around, around[1:], strict=False)), default=0.0)
            return huge, result, t1 - t0, gap

    huge, long, refused_s, gap = asyncio.run(main())
    code, _, details = huge
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in details, huge
    assert len(details) < 400  # the message says how big, it does not echo the prompt
    assert long[0] == grpc.StatusCode.OK and len(long[1]) == LONG["max_tokens"]
    print(f"3.9 MB prompt refused after {refused_s:.3f} s; longest gap between the other stream's deltas {gap:.3f} s")
    assert _alive(w)
    asyncio.run(wait_workers_idle([w.address], timeout=30))
