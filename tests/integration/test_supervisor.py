"""The supervisor of ``draftwise serve``: restart backoff, giving up on a worker that dies
while starting (with its reason on the console), exiting 1 only when no worker is left,
stable worker labels, and what the workers are given (a per-launch secret in a 0600 file)
and not given (client API keys)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwise.gateway.supervisor import Backoff, RestartPolicy, describe_exit
from draftwise.hop import read_secret_file, secret_metadata, write_secret_file
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from tests.integration.procs import ROOT, ServeProc, child_env
from tests.integration.rpc import start

SHORT = {"max_tokens": 3, "temperature": 0}


def test_backoff_doubles_up_to_the_cap_and_resets_after_a_stable_run():
    b = Backoff(RestartPolicy(backoff_initial_s=1, backoff_max_s=5, stable_after_s=60))
    assert [b.delay(served_s=2) for _ in range(5)] == [1, 2, 4, 5, 5]
    assert b.delay(served_s=60) == 1  # it served stably: start over
    assert b.delay(served_s=0) == 2
    with pytest.raises(ValueError, match="backoff"):
        RestartPolicy(backoff_initial_s=2, backoff_max_s=1)
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(2) == "exited with status 2"


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


async def _generate(address: str, metadata: tuple = ()) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gsgrpc.GenerateServiceStub(ch)
        req = gspb.GenerateStreamRequest(start=start("", **SHORT))
        events = [r.event async for r in stub.GenerateStream(req, timeout=30, metadata=metadata or None)]
    return events[-1].WhichOneof("kind")


async def _get_load(address: str, secret: str) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = wgrpc.WorkerServiceStub(ch)
        return (await stub.GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=secret_metadata(secret))).model


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


def test_a_worker_that_dies_while_restarting_is_given_up_and_serve_exits_when_none_is_left(tmp_path):
    model = tmp_path / "mymodel"
    shutil.copytree(ROOT / "worker" / "default_models" / "target", model)
    secret_file = write_secret_file(tmp_path / "my-secret", "my-own-secret-of-this-deployment")
    serve = ServeProc(tmp_path, f"--model={model}", f"--internal-secret-file={secret_file}", workers=2)
    serve.wait_listening()
    try:
        assert serve.model == "mymodel"
        first = serve.ready_workers()
        assert sorted(first) == ["worker-0", "worker-1"]
        assert serve.secret_file() == secret_file  # serve --internal-secret-file: the workers use that file
        assert asyncio.run(_get_load(first["worker-0"]["address"], "my-own-secret-of-this-deployment")) == "mymodel"
        metrics = serve.metrics()
        assert metrics['draftwise_worker_healthy{worker="worker-0"}'] == 1
        assert metrics['draftwise_worker_healthy{worker="worker-1"}'] == 1
        assert not [k for k in metrics if "127.0.0.1" in k], "labels are names, not ephemeral addresses"
        shutil.rmtree(model)  # from now on, a worker cannot start
        os.kill(first["worker-0"]["pid"], signal.SIGKILL)
        _wait_for(lambda: "error: worker 0 " in serve.log(), 60, "worker 0 given up")
        log = serve.log()
        assert f"warning: worker-0 (pid {first['worker-0']['pid']}) was killed by SIGKILL; restarting it in 1 s" in log
        assert "error: worker 0 exited with status 2 while starting; not restarting it" in log
        given_up = log[log.index("error: worker 0 ") :]
        assert "  | error: " in given_up and "mymodel" in given_up  # the worker's own reason, quoted
        # the other worker still serves: health SERVING, requests succeed, serve keeps going
        assert asyncio.run(_generate(serve.address)) == "finished"
        assert asyncio.run(_health(serve.address)) == health_pb2.HealthCheckResponse.SERVING
        metrics = serve.metrics()
        assert metrics['draftwise_worker_restarts_total{worker="worker-0"}'] == 1
        assert metrics['draftwise_worker_healthy{worker="worker-0"}'] == 0
        assert serve.popen.poll() is None
        os.kill(first["worker-1"]["pid"], signal.SIGKILL)
        assert serve.popen.wait(60) == 1
        assert "error: worker 1 exited with status 2 while starting" in serve.log()
        assert "error: no worker is left (every one was given up); stopping" in serve.log()
    finally:
        serve.close()


def test_a_restarted_worker_that_hangs_while_starting_is_given_up(tmp_path):
    serve = ServeProc(tmp_path, "--startup-timeout=15", workers=1).wait_listening()
    try:
        (first,) = serve.ready_workers().values()
        os.kill(first["pid"], signal.SIGKILL)
        new: set[int] = set()

        def restarted() -> bool:
            new.update(serve.worker_pids() - {first["pid"]})
            return bool(new)

        _wait_for(restarted, 30, "a restarted worker process")
        (pid,) = new
        os.kill(pid, signal.SIGSTOP)  # hangs while loading its model
        t_stopped = time.monotonic()
        assert asyncio.run(_health(serve.address)) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert serve.popen.wait(60) == 1
        assert time.monotonic() - t_stopped > 10  # it got its startup time first
        log = serve.log()
        assert "error: worker 0 did not start within 15 s; not restarting it" in log
        assert "error: no worker is left (every one was given up); stopping" in log
        assert pid not in serve.worker_pids()  # killed, not left behind stopped
    finally:
        serve.close()


def test_serve_gives_up_on_workers_that_start_too_slowly(tmp_path):
    serve = ServeProc(tmp_path, "--startup-timeout=0.2", workers=2)
    try:
        assert serve.popen.wait(60) == 1
        assert "error: the workers did not start within 0.2 s" in serve.log()
        _wait_for(lambda: not serve.worker_pids(), 10, "the workers gone")
    finally:
        serve.close()


def test_workers_get_a_private_secret_and_no_client_keys(tmp_path):
    env = child_env(DRAFTWISE_API_KEYS="client-key-1", DRAFTWISE_API_KEY="client-key-2", MY_KEYS="client-key-3")
    serve = ServeProc(tmp_path, "--api-keys-env=MY_KEYS", workers=1, env=env).wait_listening()
    try:
        (ready,) = serve.ready_workers().values()
        environ = Path(f"/proc/{ready['pid']}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0] for e in environ}
        assert not names & {b"DRAFTWISE_API_KEYS", b"DRAFTWISE_API_KEY", b"MY_KEYS"}
        assert b"client-key" not in b"\0".join(environ)
        secret_file = serve.secret_file()
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
        secret = read_secret_file(secret_file)

        async def calls() -> dict[str, grpc.StatusCode]:
            out = {}
            async with grpc.aio.insecure_channel(ready["address"]) as ch:
                stub = wgrpc.WorkerServiceStub(ch)
                for label, md in (
                    ("none", None),
                    ("wrong", secret_metadata("x" * 43)),
                    ("right", secret_metadata(secret)),
                ):
                    try:
                        await stub.GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=md)
                        out[label] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        out[label] = e.code()
            # the gateway sends the secret: a client with its key is served
            out["gateway"] = await _generate(serve.address, (("authorization", "Bearer client-key-3"),))
            return out

        got = asyncio.run(calls())
        assert got["none"] == got["wrong"] == grpc.StatusCode.UNAUTHENTICATED
        assert got["right"] == grpc.StatusCode.OK
        assert got["gateway"] == "finished"
        serve.popen.send_signal(signal.SIGTERM)
        assert serve.popen.wait(60) == 0
        assert not secret_file.exists()  # one secret per launch, gone with it
    finally:
        serve.close()


def test_worker_names_are_checked():
    from draftwise.gateway.config import GatewayConfig

    a, b = "127.0.0.1:1", "127.0.0.1:2"
    assert GatewayConfig(workers=(a, b), worker_names=("worker-0", "worker-1")).worker_names == ("worker-0", "worker-1")
    with pytest.raises(ValueError, match="1 worker names for 2 workers"):
        GatewayConfig(workers=(a, b), worker_names=("worker-0",))
    with pytest.raises(ValueError, match="worker name given twice: w"):
        GatewayConfig(workers=(a, b), worker_names=("w", "w"))
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.gateway", f"--worker={a}", f"--worker={a}", "--port=0"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and f"error: worker address given twice: {a}" in res.stderr, res.stderr
