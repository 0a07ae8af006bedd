"""The OpenAI-compatible HTTP endpoint, driven by the official ``openai`` SDK (and curl for the
SSE framing) against a live ``draftwise serve --http-port``: a real worker serving a model with
a chat template (tests/chat_model.py), n-gram speculation on, API keys on, one request in
flight at most (so that overload is deterministic). Greedy output over HTTP equals the gRPC
output for the same prompt; errors come in OpenAI's shape with the right status."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from draftwise.hop import read_secret_file
from tests.chat_model import chat_doc_blocks, make_chat_model
from tests.integration.procs import (
    CLIENT_DIR,
    PARENT,
    ROOT,
    Proc,
    ServeProc,
    child_env,
    said,
    secret_args,
    start_gateway,
)
from tests.integration.rpc import scrape_metrics, worker_loads

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import Client, SamplingParams  # noqa: E402

KEY = "sk-test-openai-0123"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]
PROMPT = "def fibonacci(n):"
HTTP_LINE = re.compile(r"^OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1$")


class Server:
    def __init__(self, serve: ServeProc, http_port: int) -> None:
        self.serve = serve
        self.base_url = f"http://127.0.0.1:{http_port}/v1"
        self.model = serve.model

    def client(self, key: str = KEY, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, timeout=60, **kw)  # type: ignore[arg-type]

    def grpc(self) -> Client:
        return Client(self.serve.address, api_key=KEY)

    def worker_addresses(self) -> list[str]:
        return [e["address"] for e in self.serve.ready_workers().values()]

    def wait_idle(self, timeout: float = 30.0) -> float:
        secret = read_secret_file(self.serve.secret_file())
        t0 = time.monotonic()
        while True:  # wait_workers_idle, with this serve's own secret
            loads = asyncio.run(worker_loads(self.worker_addresses(), secret))
            if all(lo.num_free_kv_blocks == lo.num_total_kv_blocks and not lo.num_requests_running for lo in loads):
                break
            assert time.monotonic() - t0 < timeout, f"workers not idle after {timeout} s: {loads}"
            time.sleep(0.02)
        while scrape_metrics(self.serve.metrics_port).get("draftwise_requests_in_flight", 0) > 0:
            assert time.monotonic() - t0 < timeout, "gateway still has requests in flight"
            time.sleep(0.02)
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("openai")
    model = make_chat_model(tmp / "chat-model")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY}\n")
    serve = ServeProc(
        tmp,
        f"--model={model}",
        "--http-port=0",
        f"--api-key-file={keys}",
        "--speculative-method=ngram",
        "--max-in-flight=1",
        "--resume-retention-s=0",
    ).wait_listening()
    try:
        line = said(serve.popen.stdout.readline().rstrip("\n"))
        m = HTTP_LINE.match(line)
        assert m, f"unexpected second line {line!r}"
        yield Server(serve, int(m[1]))
    finally:
        serve.close()


def grpc_chat(server: Server, max_tokens: int = 16, **kw: object) -> str:
    with server.grpc() as c:
        return "".join(d.text for d in c.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=max_tokens, **kw)))


def test_models(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list()] == [server.model] == ["chat-model"]
    assert client.models.retrieve("chat-model").id == "chat-model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-nope")
    assert err.value.status_code == 404
    assert err.value.body["code"] == "model_not_found"


def test_chat_completion_equals_grpc_and_counts_in_metrics(server: Server) -> None:
    before = scrape_metrics(server.serve.metrics_port)
    r = server.client().chat.completions.create(model="chat-model", messages=MESSAGES, max_tokens=16, temperature=0)
    with server.grpc() as c:
        deltas = list(c.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16)))
    assert r.choices[0].message.content == "".join(d.text for d in deltas)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == deltas[-1].usage.prompt_tokens > 10  # the rendered template
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16
    spec = r.model_extra["speculation"]  # the extension field
    assert set(spec) == {
        "proposed_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "verify_steps",
        "grammar_refused_tokens",
    }
    assert spec["verify_steps"] >= 1
    after = scrape_metrics(server.serve.metrics_port)
    key = 'draftwise_requests_total{status="length"}'
    assert after[key] - before.get(key, 0) == 2  # the HTTP request and the gRPC one


def test_chat_streaming_with_include_usage(server: Server) -> None:
    want = grpc_chat(server)
    chunks = list(
        server.client().chat.completions.create(
            model="chat-model",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # without include_usage: no usage chunk
    plain = list(
        server.client().chat.completions.create(
            model="chat-model", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
    )
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == want


def test_completions_streaming_and_not_equal_grpc(server: Server) -> None:
    with server.grpc() as c:
        deltas = list(c.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, logprobs=2)))
    want = "".join(d.text for d in deltas)
    lps = [lp for d in deltas for lp in d.logprobs]
    client = server.client()
    r = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    assert r.choices[0].text == want
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 12
    got = r.choices[0].logprobs
    assert got.tokens == [f"token_id:{lp.token_id}" for lp in lps]
    # (float32 sums may differ in the last bits between a decode step and a speculative verify step)
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    assert all(len(t) == 2 for t in got.top_logprobs)
    streamed = list(
        client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"
    # token ids as the prompt: the same output
    ids = [t for d in deltas[:1] for t in d.token_ids]  # any token ids will do; compare with gRPC on them
    with server.grpc() as c:
        want_ids = "".join(d.text for d in c.generate(ids, SamplingParams(temperature=0, max_tokens=4)))
    assert (
        client.completions.create(model="chat-model", prompt=ids, max_tokens=4, temperature=0).choices[0].text
        == want_ids
    )


def test_stop_seed_and_chat_logprobs(server: Server) -> None:
    client = server.client()
    r = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=64, temperature=0, stop=["\n"])
    assert "\n" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    a, b = (
        client.chat.completions.create(model="chat-model", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7)
        for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    with server.grpc() as c:
        seeded = "".join(d.text for d in c.chat(MESSAGES, SamplingParams(temperature=1.0, max_tokens=12, seed=7)))
    assert a.choices[0].message.content == seeded
    r = client.chat.completions.create(
        model="chat-model", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 and t.token.startswith("token_id:") for t in content)


def _raw(server: Server, path: str, body: bytes | None, key: str | None = KEY) -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.base_url + path, data=body, method="POST" if body is not None else "GET")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        ({"n": 2}, "n", "n must be 1"),
        ({"temperature": -1}, "temperature", "temperature must be"),  # named (issue 23; was null)
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be in"),
        ({"messages": []}, "messages", "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "def f(x):\n" * 400}]}, None, "render to a prompt of"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only function tools"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ],
)
def test_bad_requests_are_400_in_openai_shape(server: Server, kwargs: dict, param: str | None, match: str) -> None:
    args = {"model": "chat-model", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        server.client(max_retries=0).chat.completions.create(**args)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert re.search(match, body["message"]), body


def test_malformed_body_and_unknown_paths(server: Server) -> None:
    status, _, body = _raw(server, "/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = _raw(server, "/completions", json.dumps({"prompt": ["a", 5]}).encode())
    assert status == 400 and "a list of token ids" in body["error"]["message"]  # (a list of prompts is a batch)
    status, _, body = _raw(server, "/embeddings", b"{}")
    assert status == 404 and "no such endpoint: POST /v1/embeddings" in body["error"]["message"]
    status, _, body = _raw(server, "/completions", None)
    assert status == 405 and "GET is not allowed on /v1/completions" in body["error"]["message"]
    status, _, body = _raw(server, "/completions", b" " * (5 << 20))
    assert status == 413 and "(--max-request-bytes)" in body["error"]["message"]


def test_wrong_or_missing_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(key="sk-wrong").chat.completions.create(model="chat-model", messages=MESSAGES, max_tokens=4)
    assert err.value.status_code == 401
    assert err.value.body["message"] == "invalid API key" and err.value.body["type"] == "authentication_error"
    status, _, body = _raw(server, "/models", None, key=None)
    assert status == 401 and "missing API key" in body["error"]["message"]


def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        server.client().chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert err.value.status_code == 404
    assert err.value.body["code"] == "model_not_found" and "it serves: chat-model" in err.value.body["message"]


def test_closing_the_stream_cancels_and_frees_kv(server: Server) -> None:
    before = scrape_metrics(server.serve.metrics_port)
    stream = server.client().chat.completions.create(
        model="chat-model",
        messages=MESSAGES,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = [next(iter(stream)) for _ in range(3)]
    assert got[0].choices[0].delta.role == "assistant"
    loads = asyncio.run(worker_loads(server.worker_addresses(), read_secret_file(server.serve.secret_file())))
    assert sum(lo.num_requests_running for lo in loads) == 1  # still generating
    stream.close()
    server.wait_idle()
    after = scrape_metrics(server.serve.metrics_port)
    key = 'draftwise_requests_total{status="abort"}'  # as a gRPC client that goes away
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert after["draftwise_generation_tokens_total"] - before["draftwise_generation_tokens_total"] < 400


def test_overload_is_429_with_retry_after(server: Server) -> None:
    client = server.client(max_retries=0)
    hold = client.chat.completions.create(
        model="chat-model", messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(hold))  # admitted: the only slot (--max-in-flight=1) is taken
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 429
        assert err.value.response.headers["Retry-After"] == "1"
        assert err.value.response.headers["retry-after-ms"] == "250"
        assert "at capacity" in err.value.body["message"] and err.value.body["type"] == "rate_limit_error"
    finally:
        hold.close()
    server.wait_idle()


def test_sse_framing_with_curl(server: Server, tmp_path: Path) -> None:
    want = grpc_chat(server, max_tokens=8)
    body = {"model": "chat-model", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    res = subprocess.run(
        ["curl", "-sN", "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json"]
        + ["-d", json.dumps(body), f"{server.base_url}/chat/completions"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith("data: [DONE]\n\n")
    events = res.stdout.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_doc_sdk_snippet_runs(server: Server, tmp_path: Path) -> None:
    (block,) = chat_doc_blocks(ROOT / "docs" / "openai.md")
    assert "http://127.0.0.1:8000/v1" in block and '"unused-without-keys"' in block
    code = block.replace("http://127.0.0.1:8000/v1", server.base_url).replace('"unused-without-keys"', repr(KEY))
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(res.stdout.strip().splitlines()) >= 2


def _http_port(gateway: Proc) -> int:
    for event in gateway.log_events():
        if event.get("event") == "gateway listening":
            return int(event["http_port"])
    raise AssertionError("the gateway logged no 'gateway listening' line")


def test_gateway_https_with_its_tls_certificate(workers: list[Proc], proc_dir: Path) -> None:
    # python -m draftwise.gateway --http-port, with --tls-cert/--tls-key: HTTPS with that certificate
    openssl = shutil.which("openssl")
    assert openssl, "the HTTPS test needs the openssl command to make a self-signed certificate"
    cert, key = proc_dir / "http-cert.pem", proc_dir / "http-key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    g = start_gateway(workers, proc_dir, "gateway-https", "--http-port=0", f"--tls-cert={cert}", f"--tls-key={key}")
    try:
        base = f"https://127.0.0.1:{_http_port(g)}/v1"
        client = openai.OpenAI(
            base_url=base,
            api_key="none",
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))),
            timeout=60,
        )
        r = client.completions.create(model="draftwise-target", prompt=PROMPT, max_tokens=8, temperature=0)
        with Client(g.address, root_certificates=cert.read_bytes()) as c:
            want = c.complete(PROMPT, SamplingParams(max_tokens=8, temperature=0)).text
        assert r.choices[0].text == want
        # the default model has no chat template: 400 naming that
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="draftwise-target", messages=MESSAGES, max_tokens=4)
        assert "this model has no chat template" in err.value.body["message"]
        with pytest.raises(openai.APIConnectionError):  # plain HTTP to the HTTPS port
            openai.OpenAI(base_url=base.replace("https", "http"), api_key="none", max_retries=0).models.list()
    finally:
        g.stop()


def test_no_worker_is_503(proc_dir: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    args = ["-m", "draftwise.gateway", "--port=0", "--http-port=0", "--log-format=json", *PARENT, *secret_args()]
    g = Proc("gateway-no-worker", [*args, f"--worker=127.0.0.1:{dead}"], proc_dir).wait_ready(30)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{_http_port(g)}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="draftwise-target", prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 503
        assert err.value.body["type"] == "service_unavailable_error"
        assert "no worker has reported its model yet" in err.value.body["message"]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{_http_port(g)}/health", timeout=10)
        assert health.value.code == 503 and json.loads(health.value.read()) == {"status": "unavailable"}
    finally:
        g.stop()


def test_taken_http_port_is_an_error(proc_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "draftwise.gateway", "--port=0", f"--http-port={port}", "--worker=127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
            cwd=tmp_path,
        )
    assert res.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port} for HTTP" in res.stderr and "--http-port" in res.stderr
    assert "Traceback" not in res.stderr


def test_an_error_mid_stream_is_an_error_event(workers: list[Proc], proc_dir: Path) -> None:
    # the gateway shuts down (no grace) while a stream runs: its request ends UNAVAILABLE, sent as an SSE event
    g = start_gateway(workers, proc_dir, "gateway-http-stop", "--http-port=0", "--shutdown-grace=0")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{_http_port(g)}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="draftwise-target", prompt=PROMPT, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].text is not None
        g.popen.terminate()
        with pytest.raises(openai.APIError, match="the server shut down before the request finished"):
            for _ in chunks:
                pass
        assert g.popen.wait(30) == 0
    finally:
        g.stop()
