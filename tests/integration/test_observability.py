"""What operators see: Prometheus metrics, JSON logs carrying request ids, gRPC health,
server reflection (``buf curl``), and a gateway that imports neither torch nor the worker
package and starts quickly."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from tests.integration.procs import ROOT, child_env, metrics_port
from tests.integration.rpc import run_stream, start

BUF_MISSING = "buf is not on PATH (npm install -g @bufbuild/buf); set DRAFTWISE_REQUIRE_BUF=1 to fail instead"


def _scrape(gateway) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(gateway)}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics(gateway, workers):
    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            return await run_stream(
                stub,
                [start(f"m{i}", max_tokens=12, ignore_eos=True, temperature=0) for i in range(4)]
                + [start("bad", temperature=-1.0)],
            )

    before = _scrape(gateway)
    asyncio.run(main())
    after = _scrape(gateway)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew('draftwise_requests_total{status="length"}') == 4
    assert grew('draftwise_requests_total{status="invalid_argument"}') == 1
    assert grew("draftwise_generation_tokens_total") == 48
    assert grew("draftwise_prompt_tokens_total") > 0
    assert grew("draftwise_time_to_first_token_seconds_count") == 4
    assert grew("draftwise_inter_token_latency_seconds_count") == 4 * 11
    # the bad request is refused at admission (the gateway checks sampling parameters itself):
    # it counts by status, and has no end-to-end latency
    assert grew("draftwise_e2e_request_latency_seconds_count") == 4
    assert grew("draftwise_request_queue_time_seconds_count") == 4
    for w in workers:
        assert f'draftwise_worker_kv_cache_usage_ratio{{worker="{w.address}"}}' in after
        assert after[f'draftwise_worker_healthy{{worker="{w.address}"}}'] == 1
    assert "draftwise_spec_decode_acceptance_rate_count" in after  # 0 until speculation is served


def test_logs_are_json_and_carry_the_request_id(gateway):
    asyncio.run(_one(gateway.address, "log-me-please"))
    events = [e for e in gateway.log_events() if e.get("request_id") == "log-me-please"]
    assert events and events[-1]["event"] == "request finished" and events[-1]["status"] == "length"
    assert all(json.dumps(e) for e in events)


async def _one(address: str, rid: str) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        await run_stream(gsgrpc.GenerateServiceStub(ch), [start(rid, max_tokens=2, temperature=0)])


def test_health_serving(gateway):
    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return [
                (await stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)).status
                for s in ("", "draftwise.v1.GenerateService")
            ]

    assert asyncio.run(main()) == [health_pb2.HealthCheckResponse.SERVING] * 2


def test_buf_curl_lists_the_services(gateway):
    buf = shutil.which("buf")
    if buf is None:
        if os.environ.get("DRAFTWISE_REQUIRE_BUF"):
            pytest.fail(BUF_MISSING)
        pytest.skip(BUF_MISSING)
    # the README's command, against the test gateway
    res = subprocess.run(
        [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--list-methods", f"http://{gateway.address}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    methods = res.stdout.split()
    for m in ("Generate", "GenerateStream", "ListModels"):
        assert f"draftwise.v1.GenerateService/{m}" in methods
    assert "grpc.health.v1.Health/Check" in methods
    res = subprocess.run(
        [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge"]
        + ["-d", '{"start": {"prompt": {"text": "def f(x):"}, "sampling_params": {"max_tokens": 3}}}']
        + [f"http://{gateway.address}/draftwise.v1.GenerateService/GenerateStream"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and "FINISH_REASON_LENGTH" in res.stdout, res.stderr


def test_gateway_imports_neither_torch_nor_the_worker():
    code = (
        "import sys, time, json; t = time.perf_counter(); "
        "import draftwise.gateway.server, draftwise.gateway.main, draftwise.gateway.launcher, draftwise.cli; "
        "dt = time.perf_counter() - t; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('draftwise.worker')); "
        "print(json.dumps({'seconds': dt, 'bad': bad}))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bad"] == []
    # how long the import took is a benchmark figure, not a test's (no test may depend on machine speed)
    print(f"importing the gateway took {out['seconds']:.2f} s")
