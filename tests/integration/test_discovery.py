"""Worker discovery with real processes: a gateway started with ``--worker-dns`` on a name that
stands for no worker picks up a worker started afterwards, serves through it, picks up a second
one, and drops the first once the name no longer lists it (its in-flight request finishes there
first), while completions keep working on the other. Names resolve through a hosts file the test
edits (``--hosts-file``); each worker listens on its own loopback address (127.x.y.z: no root
needed), all on the same port, as the pods of a Kubernetes headless Service do."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from tests.integration.procs import ENGINE_ARGS, PARENT, Proc, child_env, metrics_port, secret_args, start_gateway
from tests.integration.rpc import run_stream, scrape_metrics, start

NAME = "workers.draftwise.test"


def loopback_addresses(n: int) -> list[str]:
    """``n`` loopback addresses of one random 127.x.y.0/24 (parallel runs rarely share one)."""
    a, b = random.randrange(1, 255), random.randrange(1, 255)
    return [f"127.{a}.{b}.{i}" for i in range(2, 2 + n)]


def common_free_port(hosts: list[str]) -> int:
    """A port free on every one of ``hosts`` right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
        except OSError:
            continue
        return port
    raise AssertionError("no common free port")


def start_worker_at(name: str, host: str, port: int, tmp: Path) -> Proc:
    args = ["-m", "draftwise.worker.server", f"--host={host}", f"--port={port}", "--log-format=json"]
    return Proc(name, [*args, *PARENT, *secret_args(), *ENGINE_ARGS], tmp)


def write_hosts(path: Path, addresses: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# written by test_discovery\n" + "".join(f"{a} {NAME}\n" for a in addresses))
    tmp.replace(path)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def healthz(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def healthy_workers(port: int) -> dict[str, float]:
    """{worker label: 0/1} of draftwise_worker_healthy."""
    out = {}
    for key, value in scrape_metrics(port).items():
        if key.startswith("draftwise_worker_healthy{"):
            out[key.split('worker="', 1)[1].split('"', 1)[0]] = value
    return out


def complete(address: str, request_id: str, max_tokens: int = 8) -> dict:
    async def main() -> dict:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            return await run_stream(stub, [start(request_id, max_tokens=max_tokens, temperature=0, ignore_eos=True)])

    return asyncio.run(main())


@pytest.mark.slow
def test_gateway_discovers_and_drops_workers(tmp_path: Path) -> None:
    hosts = loopback_addresses(2)
    port = common_free_port(hosts)
    hosts_file = tmp_path / "hosts"
    write_hosts(hosts_file, [])
    gateway = start_gateway(
        [],
        tmp_path,
        "gateway",
        f"--worker-dns={NAME}:{port}",
        f"--hosts-file={hosts_file}",
        "--discovery-interval-s=0.3",
    )
    workers: list[Proc] = []
    try:
        mport = metrics_port(gateway)
        # nothing behind the name: alive, but not serving
        assert healthz(mport) == 503
        assert healthy_workers(mport) == {}
        # a worker started afterwards joins once its name lists it
        workers.append(start_worker_at("w0", hosts[0], port, tmp_path).wait_ready())
        write_hosts(hosts_file, hosts[:1])
        first = f"{hosts[0]}:{port}"
        wait_for("the first worker joins", lambda: healthy_workers(mport).get(first) == 1.0)
        assert healthz(mport) == 200
        r = complete(gateway.address, "a")["a"]
        assert r.kind == "finished" and len(r.token_ids) == 8
        # a second one
        workers.append(start_worker_at("w1", hosts[1], port, tmp_path).wait_ready())
        write_hosts(hosts_file, hosts)
        second = f"{hosts[1]}:{port}"
        wait_for("the second worker joins", lambda: healthy_workers(mport).get(second) == 1.0)

        # the first leaves the name while it runs a request: the request finishes there, then it is dropped
        async def long_request_while_retired() -> dict:
            async with grpc.aio.insecure_channel(gateway.address) as ch:
                stub = gsgrpc.GenerateServiceStub(ch)
                task = asyncio.create_task(
                    run_stream(
                        stub, [start(f"long{i}", max_tokens=150, temperature=0, ignore_eos=True) for i in range(2)]
                    )
                )
                await asyncio.sleep(0.5)  # both running, one on each worker (least loaded)
                write_hosts(hosts_file, hosts[1:])
                return await task

        results = asyncio.run(long_request_while_retired())
        for r in results.values():
            assert r.kind == "finished", r.final
            assert len(r.token_ids) == 150
        wait_for("the first worker is dropped", lambda: first not in healthy_workers(mport))
        assert healthy_workers(mport) == {second: 1.0}
        events = [e for e in gateway.log_events() if e.get("worker") == first]
        retiring = [e for e in events if e.get("event") == "worker retiring"]
        assert retiring and retiring[0]["in_flight"] == 1, events  # it still ran the request: drained, not cut
        assert any(e.get("event") == "worker dropped" for e in events)
        workers[0].stop()
        # completions go on through the worker that is left
        r = complete(gateway.address, "b")["b"]
        assert r.kind == "finished" and len(r.token_ids) == 8
        # and the last one vanishing (stopped and gone from the name) leaves the gateway not serving
        workers[1].stop()
        write_hosts(hosts_file, [])
        wait_for("no worker is left", lambda: healthy_workers(mport) == {})
        assert healthz(mport) == 503
    finally:
        for w in workers:
            w.kill()
        gateway.stop()


def _gateway_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or child_env(),
    )


def test_gateway_needs_workers_and_readable_hosts_file(tmp_path: Path) -> None:
    p = _gateway_cli("--port=0")
    assert p.returncode == 2
    assert "give workers: --worker HOST:PORT and/or --worker-dns NAME:PORT" in p.stderr
    p = _gateway_cli("--port=0", "--worker-dns=workers")
    assert p.returncode == 2 and "not NAME:PORT: 'workers'" in p.stderr
    p = _gateway_cli("--port=0", f"--worker-dns={NAME}:1", f"--hosts-file={tmp_path / 'missing'}")
    assert p.returncode == 2
    assert p.stderr.strip() == f"error: --hosts-file {tmp_path / 'missing'}: No such file or directory"
    bad = tmp_path / "hosts"
    bad.write_text("not-an-ip workers\n")
    p = _gateway_cli("--port=0", f"--worker-dns={NAME}:1", f"--hosts-file={bad}")
    assert p.returncode == 2 and f"{bad}:1: not an IP address: 'not-an-ip'" in p.stderr
    p = _gateway_cli("--port=0", f"--worker-dns={NAME}:1", "--discovery-interval-s=0")
    assert p.returncode == 2 and "the discovery interval must be > 0 seconds" in p.stderr
