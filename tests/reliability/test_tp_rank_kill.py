"""Killing one tensor-parallel rank mid-stream: ``draftwise serve --workers 2
--tensor-parallel-size 2`` (each worker = rank 0 + one follower process, gloo over 127.0.0.1).
SIGKILL of the follower of the worker serving a long greedy stream: that worker's engine stops
at its next collective, the worker exits non-zero well within the collective timeout, the
supervisor restarts it (a new process with its own new follower), and the stream completes by
failover on the other worker with exactly the tokens an undisturbed engine produces."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker import LLM, SamplingParams
from draftwise.worker.parallel.leader import DATA_TIMEOUT_S
from tests.integration.procs import ENGINE_KWARGS, ServeProc
from tests.integration.rpc import Result, start, start_req

pytestmark = pytest.mark.slow

PROMPT = "# the rank-kill test\ndef merge_sorted(a, b):"
LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    s = ServeProc(tmp_path_factory.mktemp("tp"), "--tensor-parallel-size=2", workers=2).wait_listening(300)
    yield s
    s.close()


def _followers(pid: int) -> list[int]:
    """The child processes of ``pid`` that are tensor-parallel ranks."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and "draftwise.worker.engine.follower" in cmd:
            out.append(int(p.name))
    return out


def test_killing_a_rank_mid_stream_fails_over_exactly(serve):
    before = serve.ready_workers()
    assert len(before) == 2
    for w in before.values():
        assert len(_followers(w["pid"])) == 1, "each worker runs one follower rank"
    expected = LLM(**ENGINE_KWARGS).generate([PROMPT], SamplingParams(**LONG), use_tqdm=False)[0]
    expected_ids = list(expected.outputs[0].token_ids)

    async def main():
        async with grpc.aio.insecure_channel(serve.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.Generate(timeout=300)
            await call.write(start_req(start("tp", PROMPT, **LONG)))
            await call.done_writing()
            result = Result("tp")
            while len(result.token_ids) < 20:
                resp = await call.read()
                assert resp != grpc.aio.EOF
                result.add(resp.event)
            # the worker running it: the one whose engine reports a running request
            victim = await _worker_running(serve)
            (follower,) = _followers(before[victim]["pid"])
            t_kill = time.time()
            os.kill(follower, signal.SIGKILL)
            while True:
                resp = await call.read()
                if resp == grpc.aio.EOF:
                    break
                result.add(resp.event)
            return result, victim, t_kill

    result, victim, t_kill = asyncio.run(main())
    assert result.finish_reason == pb.FINISH_REASON_LENGTH, result.final
    assert result.token_ids == expected_ids, "the stream after failover differs from an undisturbed run"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        after = serve.ready_workers()
        if after[victim]["pid"] != before[victim]["pid"]:
            break
        time.sleep(0.2)
    after = serve.ready_workers()
    assert after[victim]["pid"] != before[victim]["pid"] and after[victim]["restarts"] >= 1
    died = [e for e in serve.log_events() if e.get("event") == "worker died; restarting it" and e["worker"] == victim]
    assert died and died[-1]["status"] not in (0, None), died  # non-zero: the engine stopped, not a clean exit
    engine_stop = [e for e in serve.log_events() if "tensor-parallel" in str(e.get("error", ""))]
    assert engine_stop, "the worker's log says a tensor-parallel rank failed"
    assert len(_followers(after[victim]["pid"])) == 1, "the restarted worker has its own follower"
    # the worker went down well before a collective could time out: it saw the closed connection
    died_at = datetime.fromisoformat(died[-1]["timestamp"].replace("Z", "+00:00")).timestamp()
    print(f"\nrank killed -> worker exited: {died_at - t_kill:.2f} s (collective timeout {DATA_TIMEOUT_S:g} s)")
    assert 0 <= died_at - t_kill < DATA_TIMEOUT_S


async def _worker_running(serve: ServeProc) -> str:
    from draftwise.hop import read_secret_file, secret_metadata
    from draftwise.v1 import worker_service_pb2 as wpb
    from draftwise.v1 import worker_service_pb2_grpc as wgrpc

    md = secret_metadata(read_secret_file(serve.secret_file()))
    for name, w in serve.ready_workers().items():
        async with grpc.aio.insecure_channel(w["address"]) as ch:
            load = await wgrpc.WorkerServiceStub(ch).GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=md)
        if load.num_requests_running:
            return name
    raise AssertionError("no worker runs the stream")
