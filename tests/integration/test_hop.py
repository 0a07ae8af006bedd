"""The internal hop (defect 7): a worker answers only calls that carry its launch's secret
(health stays open), refuses to start without one unless told ``--insecure-internal``, a
gateway without the secret cannot use it, and Drain can be undone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwise import hop
from draftwise.hop import read_secret_file, secret_metadata, write_secret_file
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from tests.integration.procs import ENGINE_ARGS, PARENT, Proc, child_env, start_gateway, start_workers
from tests.integration.rpc import start, worker_loads, worker_metadata

SHORT = {"max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def lone(proc_dir):
    """One worker and a gateway of its own (these tests drain it)."""
    (worker,) = start_workers(1, proc_dir, prefix="hop")
    try:
        gateway = start_gateway([worker], proc_dir, "gateway-hop")
    except BaseException:
        worker.kill()
        raise
    yield worker, gateway
    gateway.stop()
    worker.stop()


async def _worker_call(address: str, method: str, metadata) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = wgrpc.WorkerServiceStub(ch)
        try:
            if method == "Generate":
                req = wpb.WorkerServiceGenerateRequest(start=start("direct", **SHORT))
                [r async for r in stub.Generate(req, timeout=30, metadata=metadata)]
            elif method == "GetLoad":
                await stub.GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=metadata)
            else:  # Drain, undone at once when it went through
                await stub.Drain(wpb.DrainRequest(), timeout=5, metadata=metadata)
                await stub.Drain(wpb.DrainRequest(resume=True), timeout=5, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", ["Generate", "GetLoad", "Drain"])
def test_worker_calls_need_the_secret(lone, method):
    worker, _ = lone
    wrong = secret_metadata("not-the-secret-of-this-launch")
    assert asyncio.run(_worker_call(worker.address, method, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(_worker_call(worker.address, method, wrong)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(_worker_call(worker.address, method, worker_metadata())) == grpc.StatusCode.OK
    assert not asyncio.run(worker_loads([worker.address]))[0].draining


def test_worker_health_stays_open(lone):
    worker, _ = lone

    async def check() -> int:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


def test_drain_is_undone_by_resume(lone):
    worker, gateway = lone

    async def through_gateway() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            req = gspb.GenerateStreamRequest(start=start("", **SHORT))
            try:
                [r async for r in gsgrpc.GenerateServiceStub(ch).GenerateStream(req, timeout=30)]
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    async def until_gateway(code: grpc.StatusCode) -> tuple[grpc.StatusCode, str]:
        for _ in range(100):  # the gateway polls every 0.5 s
            got = await through_gateway()
            if got[0] == code:
                return got
            await asyncio.sleep(0.1)
        return got

    async def main():
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = wgrpc.WorkerServiceStub(ch)
            drained = await stub.Drain(wpb.DrainRequest(), timeout=5, metadata=worker_metadata())
            load = await stub.GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=worker_metadata())
            direct = await _worker_call(worker.address, "GetLoad", worker_metadata())
            try:
                req = wpb.WorkerServiceGenerateRequest(start=start("d", **SHORT))
                [r async for r in stub.Generate(req, timeout=30, metadata=worker_metadata())]
                refused = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                refused = e.code()
            while_drained = await until_gateway(grpc.StatusCode.UNAVAILABLE)
            resumed = await stub.Drain(wpb.DrainRequest(resume=True), timeout=5, metadata=worker_metadata())
            after = await stub.GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=worker_metadata())
            back = await until_gateway(grpc.StatusCode.OK)
        return drained, load, direct, refused, while_drained, resumed, after, back

    drained, load, direct, refused, while_drained, resumed, after, back = asyncio.run(main())
    assert drained.num_requests_in_flight == 0 and load.draining and direct == grpc.StatusCode.OK
    assert refused == grpc.StatusCode.UNAVAILABLE  # a draining worker takes no new request
    assert while_drained[0] == grpc.StatusCode.UNAVAILABLE and "no healthy worker" in while_drained[1]
    assert resumed.num_requests_in_flight == 0 and not after.draining
    assert back == (grpc.StatusCode.OK, "")  # the gateway took it back


def test_a_gateway_without_the_secret_cannot_use_the_workers(lone, proc_dir):
    worker, _ = lone
    wrong = proc_dir / "wrong-secret"
    if not wrong.exists():
        write_secret_file(wrong, "a-secret-of-another-launch-0123456789")
    g = start_gateway([worker], proc_dir, "gateway-wrong-secret", f"--internal-secret-file={wrong}")
    try:

        async def call() -> tuple[int, grpc.StatusCode, str]:
            async with grpc.aio.insecure_channel(g.address) as ch:
                status = (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status
                req = gspb.GenerateStreamRequest(start=start("", **SHORT))
                try:
                    [r async for r in gsgrpc.GenerateServiceStub(ch).GenerateStream(req, timeout=30)]
                except grpc.aio.AioRpcError as e:
                    return status, e.code(), e.details()
            return status, grpc.StatusCode.OK, ""

        status, code, details = asyncio.run(call())
    finally:
        g.stop()
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == grpc.StatusCode.UNAVAILABLE, details
    downs = [e for e in g.log_events() if e.get("event") == "worker down"]
    assert downs and "UNAUTHENTICATED" in downs[0]["reason"], downs


def _worker(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "draftwise.worker.serving.server", "--port=0", *PARENT, *ENGINE_ARGS, *flags],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_a_worker_refuses_to_start_without_a_secret(tmp_path):
    res = _worker(tmp_path)
    assert res.returncode == 2
    assert "error: a worker needs --internal-secret-file" in res.stderr and "--insecure-internal" in res.stderr
    short = tmp_path / "short"
    write_secret_file(short, "tooshort")
    res = _worker(tmp_path, f"--internal-secret-file={short}")
    assert res.returncode == 2 and "holds 8 characters; it needs at least 16" in res.stderr, res.stderr
    res = _worker(tmp_path, f"--internal-secret-file={tmp_path / 'missing'}")
    assert res.returncode == 2 and "cannot read the internal secret file" in res.stderr, res.stderr


def test_an_insecure_worker_serves_without_a_secret(tmp_path):
    w = Proc(
        "insecure",
        ["-m", "draftwise.worker.serving.server", "--port=0", "--insecure-internal", *PARENT, *ENGINE_ARGS],
        tmp_path,
    )
    try:
        w.wait_ready()
        assert asyncio.run(_worker_call(w.address, "GetLoad", None)) == grpc.StatusCode.OK
    finally:
        w.stop()


SECRET = "s" * 43


@pytest.mark.parametrize(
    ("mode", "warns"),
    [
        (0o600, False),  # draftwise serve's own file
        (0o400, False),
        (0o640, False),  # shared with a group
        (0o440, False),  # a Kubernetes Secret mounted for the pod's fsGroup (root-owned, group-readable)
        (0o660, False),
        (0o644, True),  # every user can read it
        (0o604, True),
        (0o444, True),
        (0o602, True),  # every user can replace it
    ],
    ids=lambda v: f"{v:04o}" if isinstance(v, int) and not isinstance(v, bool) else str(v),
)
def test_secret_file_warns_only_when_every_user_can_reach_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, warns: bool
) -> None:
    """Owner or group access is what a secret file needs (the group case is how Kubernetes mounts
    one for a non-root user, and the operator cannot chmod a mounted Secret); a warning on every
    pod for it trains operators to ignore the one that matters, world access."""
    f = tmp_path / "internal-secret"
    f.write_text(SECRET + "\n")
    f.chmod(mode)
    with structlog.testing.capture_logs() as logs:
        # a fresh proxy: a logger another test already used may be cached on the old configuration
        monkeypatch.setattr(hop, "log", structlog.get_logger("draftwise.hop"))
        assert read_secret_file(f) == SECRET
    warnings = [e for e in logs if e["log_level"] == "warning"]
    if warns:
        (w,) = warnings
        assert "open to every user" in w["event"] and w["mode"] == f"{mode:04o}" and w["path"] == str(f), w
    else:
        assert warnings == [], warnings
