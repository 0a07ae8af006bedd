"""Health checks a container runtime can use, against real processes: ``draftwise health
HOST:PORT`` (exit 0 on SERVING, 1 otherwise with a one-line reason) for a gateway and a worker,
and the gateway's HTTP ``/healthz`` (200 with a serving worker, 503 without; other paths 404)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.procs import Proc, child_env, metrics_port, start_gateway


def health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "health", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )


def http_status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def idle_gateway(tmp_path: Path):
    """A gateway whose only worker name stands for nothing: up, not serving."""
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    g = start_gateway([], tmp_path, "idle-gateway", "--worker-dns=nothing.test:50061", f"--hosts-file={hosts}")
    yield g
    g.stop()


def test_health_serving(gateway: Proc, workers: list[Proc]) -> None:
    for target in (gateway.address, workers[0].address):  # a worker answers without the internal secret
        p = health(target, "--timeout=10")
        assert p.returncode == 0, p.stderr
        assert p.stdout == f"{target}: SERVING\n"


def test_health_not_serving(idle_gateway: Proc) -> None:
    p = health(idle_gateway.address)
    assert p.returncode == 1
    assert p.stderr == f"{idle_gateway.address}: health is NOT_SERVING\n"
    p = health(idle_gateway.address, "--service=no.such.Service")
    assert p.returncode == 1 and p.stderr.startswith(f"{idle_gateway.address}: NOT_FOUND")


def test_health_unreachable_and_bad_flags(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = health(f"127.0.0.1:{port}", "--timeout=2")
    assert p.returncode == 1
    assert p.stderr.startswith(f"127.0.0.1:{port}: UNAVAILABLE") and p.stderr.count("\n") == 1
    p = health("127.0.0.1:1", "--timeout=0")
    assert p.returncode == 2 and p.stderr == "error: --timeout must be > 0\n"
    p = health("127.0.0.1:notaport")
    assert p.returncode == 2 and "not HOST:PORT: '127.0.0.1:notaport'" in p.stderr
    p = health("127.0.0.1:1", f"--tls-ca={tmp_path / 'missing.pem'}")
    assert p.returncode == 2 and p.stderr == f"error: --tls-ca {tmp_path / 'missing.pem'}: No such file or directory\n"


def test_healthz_tells_the_truth(gateway: Proc, idle_gateway: Proc) -> None:
    status, body = http_status(metrics_port(gateway), "/healthz")
    assert (status, body) == (200, "ok\n")
    status, body = http_status(metrics_port(idle_gateway), "/healthz")
    assert (status, body) == (503, "no serving worker\n")
    status, body = http_status(metrics_port(idle_gateway), "/health")  # the OpenAI port's name, here too
    assert (status, body) == (503, "no serving worker\n")
    for path in ("/", "/metricsx", "/healthz/x", "/health/x"):
        status, body = http_status(metrics_port(gateway), path)
        assert status == 404 and "try /metrics, /healthz or /health" in body
    status, body = http_status(metrics_port(gateway), "/metrics")
    assert status == 200 and "draftwise_requests_in_flight" in body


@pytest.mark.parametrize("how", ["gateway", "serve"])
def test_healthz_turns_503_at_shutdown(workers: list[Proc], tmp_path: Path, how: str) -> None:
    """A standalone gateway and `draftwise serve` alike: 503 from the first moment of the
    shutdown, while an in-flight request still finishes."""
    import threading

    import grpc

    from draftwise.v1 import generate_service_pb2 as gspb
    from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
    from tests.integration.procs import ServeProc
    from tests.integration.rpc import start

    if how == "gateway":
        g = start_gateway(workers, tmp_path, "stopping-gateway", "--shutdown-grace=20")
        port = metrics_port(g)
    else:
        g = ServeProc(tmp_path, "--shutdown-grace=20").wait_listening()
        port = g.metrics_port
    try:
        assert http_status(port, "/healthz")[0] == 200
        got: list[int] = []
        first = threading.Event()
        tokens = 450  # ~4 s here: still streaming well after healthz turns 503, even on a fast machine

        def stream() -> None:
            with grpc.insecure_channel(g.address) as ch:
                req = gspb.GenerateStreamRequest(start=start("x", max_tokens=tokens, temperature=0, ignore_eos=True))
                for resp in gsgrpc.GenerateServiceStub(ch).GenerateStream(req, timeout=60):
                    if resp.event.WhichOneof("kind") == "delta":
                        got.extend(resp.event.delta.token_ids)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        g.popen.terminate()  # SIGTERM: in-flight requests get the grace period
        t0 = time.monotonic()
        while http_status(port, "/healthz")[0] != 503:
            assert time.monotonic() < t0 + 30, "healthz still 200 after SIGTERM"
            time.sleep(0.05)
        print(f"healthz 503 {time.monotonic() - t0:.3f} s after SIGTERM, {len(got)} of {tokens} tokens streamed")
        assert g.popen.poll() is None and t.is_alive()  # still finishing its request
        t.join(60)
        assert len(got) == tokens
    finally:
        g.stop() if how == "gateway" else g.close()
