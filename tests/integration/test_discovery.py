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
from tests.integration.rpc import Result, run_stream, scrape_metrics, start, start_req, worker_loads

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
    args = ["-m", "draftwise.worker.serving.server", f"--host={host}", f"--port={port}", "--log-format=json"]
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


def healthz(port: int, path: str = "/healthz") -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
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


LONG = 450  # tokens: surely still running when the test acts (the context is 512)


def long_requests_while(
    gateway: Proc, action: Callable[[], None], busy: str = "", n: int = 2, tokens: int = LONG
) -> dict:
    """``n`` greedy requests on one stream, each with its own prompt (new prompts go to the
    least-loaded worker: the router spreads them over the workers);
    ``action`` runs once every one of them has streamed a few tokens (and, given ``busy``, right
    after the worker at that address said it runs one); every request's result."""

    async def main() -> dict:
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
            results = {f"long{i}": Result(f"long{i}") for i in range(n)}
            for rid in results:
                prompt = f"# {rid}\ndef fibonacci(n):"
                await call.write(start_req(start(rid, prompt, max_tokens=tokens, temperature=0, ignore_eos=True)))
            while not all(len(r.token_ids) >= 3 for r in results.values()):
                ev = (await call.read()).event
                results[ev.request_id].add(ev)
            if busy:
                (load,) = await worker_loads([busy])
                assert load.num_requests_running == 1, load
            await asyncio.to_thread(action)
            await call.done_writing()
            while (resp := await call.read()) != grpc.aio.EOF:
                results[resp.event.request_id].add(resp.event)
            assert await call.code() == grpc.StatusCode.OK
            return results

    return asyncio.run(main())


@pytest.mark.slow
def test_gateway_discovers_and_drops_workers(tmp_path: Path) -> None:
    hosts = loopback_addresses(3)
    port = common_free_port(hosts)
    addr = [f"{h}:{port}" for h in hosts]
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
        assert healthz(mport, "/health") == 503  # the OpenAI port's name answers the same on this port
        assert healthy_workers(mport) == {}
        # a worker started afterwards joins once its name lists it, and serves
        workers.append(start_worker_at("w0", hosts[0], port, tmp_path).wait_ready())
        write_hosts(hosts_file, hosts[:1])
        wait_for("the first worker joins", lambda: healthy_workers(mport).get(addr[0]) == 1.0)
        assert healthz(mport) == 200
        assert healthz(mport, "/health") == 200
        r = complete(gateway.address, "a")["a"]
        assert r.kind == "finished" and len(r.token_ids) == 8
        # a second one
        workers.append(start_worker_at("w1", hosts[1], port, tmp_path).wait_ready())
        write_hosts(hosts_file, hosts[:2])
        wait_for("the second worker joins", lambda: healthy_workers(mport).get(addr[1]) == 1.0)

        # the first leaves the name while it runs a request: the request finishes there, then it is dropped
        drained = long_requests_while(gateway, lambda: write_hosts(hosts_file, hosts[1:2]), busy=addr[0])
        for r in drained.values():
            assert r.kind == "finished" and len(r.token_ids) == LONG, r.final
        wait_for("the first worker is dropped", lambda: addr[0] not in healthy_workers(mport))
        assert healthy_workers(mport) == {addr[1]: 1.0}
        events = [e for e in gateway.log_events() if e.get("worker") == addr[0]]
        retiring = [e for e in events if e.get("event") == "worker retiring"]
        assert retiring and retiring[0]["in_flight"] == 1, events  # it still ran a request: drained, not cut
        assert any(e.get("event") == "worker dropped" for e in events)
        workers[0].stop()

        # a third joins; then the second dies and leaves the name mid-request: its request fails over
        workers.append(start_worker_at("w2", hosts[2], port, tmp_path).wait_ready())
        write_hosts(hosts_file, hosts[1:])
        wait_for("the third worker joins", lambda: healthy_workers(mport).get(addr[2]) == 1.0)

        def kill_second() -> None:
            workers[1].kill()
            write_hosts(hosts_file, hosts[2:])

        # it runs one of them when it dies, hundreds of tokens short of the end: the kill cuts it
        moved = long_requests_while(gateway, kill_second, busy=addr[1])
        for rid, r in moved.items():
            assert r.kind == "finished", r.final
            assert r.token_ids == drained[rid].token_ids  # greedy: token for token what an undisturbed run gives
        assert scrape_metrics(mport).get('draftwise_failovers_total{reason="unavailable"}', 0) >= 1
        wait_for("the dead worker is dropped", lambda: healthy_workers(mport) == {addr[2]: 1.0})
        # completions go on through the worker that is left
        r = complete(gateway.address, "b")["b"]
        assert r.kind == "finished" and len(r.token_ids) == 8
        # the last one stopped and gone from the name: the gateway is up but not serving
        workers[2].stop()
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


def test_hosts_file_resolution(tmp_path: Path) -> None:
    from draftwise.gateway.discovery import Discovery, DiscoveryConfig, read_hosts_file, resolve

    f = tmp_path / "hosts"
    f.write_text("# comment\n10.0.0.5 Workers w  # trailing\n\n10.0.0.6 workers\n::1 workers\n10.0.0.5 workers\n")
    assert read_hosts_file(f) == {"workers": ["10.0.0.5", "10.0.0.6", "::1"], "w": ["10.0.0.5"]}
    assert asyncio.run(resolve("WORKERS", 50061, str(f))) == ["10.0.0.5:50061", "10.0.0.6:50061", "[::1]:50061"]
    assert asyncio.run(resolve("other", 50061, str(f))) == []  # not in the file: no worker
    # the system resolver (getaddrinfo, off the event loop)
    assert "127.0.0.1:7" in asyncio.run(resolve("localhost", 7))
    # a round whose file cannot be read or parsed keeps the previous round's answer
    d = Discovery(None, DiscoveryConfig(targets=(("workers", 1),), hosts_file=str(f)))  # type: ignore[arg-type]
    assert asyncio.run(d._resolve_all()) == {"10.0.0.5:1", "10.0.0.6:1", "[::1]:1"}
    f.write_text("10.0.0.300 workers\n")
    assert asyncio.run(d._resolve_all()) == {"10.0.0.5:1", "10.0.0.6:1", "[::1]:1"}
    f.unlink()
    assert asyncio.run(d._resolve_all()) == {"10.0.0.5:1", "10.0.0.6:1", "[::1]:1"}
    f.write_text("10.0.0.7 workers\n")
    assert asyncio.run(d._resolve_all()) == {"10.0.0.7:1"}
    with pytest.raises(ValueError, match=r"hosts:1: an address without a name"):
        f.write_text("10.0.0.7\n")
        read_hosts_file(f)
