"""Checks the gateway makes itself, with no worker up (issue 23): a request with a bad sampling
parameter is INVALID_ARGUMENT over gRPC and 400 naming the field over HTTP, not the 503 of "no
worker"; a good one is UNAVAILABLE / 503. The HTTP port answers ``/health`` and ``/healthz``
and serves the gateway's Prometheus metrics at ``/metrics``."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import Proc, start_gateway

BAD = [  # (gRPC sampling params, HTTP body fields, the field named)
    ({"temperature": -1.0}, {"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, {"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, {"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, {"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, {"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, {"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, {"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, {"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 21}, {"logprobs": 21}, "logprobs"),
    ({"max_tokens": 4, "min_tokens": 5}, {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
]


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lonely(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, int]]:
    """A gateway whose one worker address has nothing listening: no worker is healthy."""
    tmp: Path = tmp_path_factory.mktemp("lonely")
    g = start_gateway([], tmp, "lonely", f"--worker=127.0.0.1:{_dead_port()}", "--http-port=0")
    http_port = next(int(e["http_port"]) for e in g.log_events() if e.get("event") == "gateway listening")
    yield g, http_port
    g.stop()


def _grpc_code(g: Proc, params: dict) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(g.address) as ch:
        stub = gsgrpc.GenerateServiceStub(ch)
        start = pb.StartGeneration(prompt=pb.Prompt(text="def f(x):"), sampling_params=pb.SamplingParams(**params))
        try:
            for _ in stub.GenerateStream(gspb.GenerateStreamRequest(start=start), timeout=10):
                pass
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def http(port: int, path: str, body: dict | None = None) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


@pytest.mark.parametrize(("params", "fields", "param"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_sampling_is_invalid_argument_with_no_worker(lonely, params, fields, param):
    g, port = lonely
    code, details = _grpc_code(g, params)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert param in details
    for path, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        status, ctype, body = http(port, path, {"model": "m", **extra, **fields})
        assert status == 400 and ctype.startswith("application/json"), (status, body)
        err = json.loads(body)["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_good_request_is_unavailable_with_no_worker(lonely):
    g, port = lonely
    code, _ = _grpc_code(g, {"temperature": 0.5, "top_p": 0.9, "max_tokens": 4})
    assert code == grpc.StatusCode.UNAVAILABLE
    status, _, body = http(port, "/v1/completions", {"prompt": "x", "temperature": 0.5, "max_tokens": 4})
    assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable_error"


def test_health_paths_and_metrics_on_the_http_port(lonely):
    _, port = lonely
    for path in ("/health", "/healthz"):
        status, ctype, body = http(port, path)
        assert status == 503 and json.loads(body) == {"status": "unavailable"}, (path, status, body)
    http(port, "/v1/completions", {"prompt": "x", "max_tokens": 4})  # admitted to the check: 503, counted
    status, ctype, body = http(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain"), (status, ctype)
    text = body.decode()
    assert "draftwise_time_to_first_token_seconds_bucket" in text
    assert 'draftwise_requests_total{status="unavailable"}' in text, text[-3000:]
