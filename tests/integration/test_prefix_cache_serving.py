"""Prefix caching through the gateway (issue 26), with real processes on 127.0.0.1: a prompt goes
back to the worker that holds its prefix and reports the tokens it reused, in Usage and in
OpenAI's ``usage.prompt_tokens_details.cached_tokens`` (parsed by the official SDK); distinct
prefixes spread over the workers; API keys do not share a cache under ``--prefix-cache-scope
key`` and do under ``shared``; ``draftwise serve --no-enable-prefix-caching`` reuses nothing.

Gateways of their own run on the session's two workers (tests/integration/conftest.py); the
chat completions and the cache-off case each start a ``draftwise serve``."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from tests.chat_model import make_chat_model
from tests.integration.procs import CLIENT_DIR, MODEL_NAME, Proc, ServeProc, said, start_gateway
from tests.integration.rpc import Result, run_stream, scrape_metrics, start, worker_loads

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import Client, SamplingParams  # noqa: E402

KEY_A, KEY_B = "sk-prefix-alice-0123", "sk-prefix-bob-4567"
BLOCK_SIZE = 16  # the engine's default
PREAMBLE = (
    "You are a careful assistant for a software team. Answer in Python, explain each step in a "
    "comment, prefer the standard library, and keep functions short. "
) * 3
"""About 130 tokens of shared preamble: several full KV blocks."""


OUTCOMES = ("new", "hit", "spill", "fallback")


def prompt(tag: str) -> str:
    """A long prompt whose first bytes (the route key's) carry ``tag``."""
    return f"# task {tag}\n{PREAMBLE}\ndef solve_{tag.replace('-', '_')}(data):"


def fresh() -> str:
    return uuid.uuid4().hex[:12]


def assert_reused(usage_prompt: int, cached: int) -> None:
    """Every full block of the prompt but the one holding its last token came from the cache."""
    assert usage_prompt - BLOCK_SIZE <= cached < usage_prompt, (usage_prompt, cached)


def grpc_usage(gw: Proc, text: str, key: str, rid: str | None = None) -> tuple[Result, str]:
    """One request on a Generate stream with API key ``key`` ("": none): its result and the worker it ran on."""
    rid = rid or f"r-{fresh()}"

    async def go() -> Result:
        async with grpc.aio.insecure_channel(gw.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            metadata = [("authorization", f"Bearer {key}")] if key else []
            got = await run_stream(stub, [start(rid, text, max_tokens=4, temperature=0)], metadata)
        return got[rid]

    result = asyncio.run(go())
    assert result.kind == "finished", result.final
    return result, worker_of(gw, rid)


def worker_of(gw: Proc, rid: str, timeout: float = 5.0) -> str:
    """The worker address the gateway's log says request ``rid`` finished on."""
    deadline = time.monotonic() + timeout
    while True:
        for e in gw.log_events():
            if e.get("event") == "request finished" and e.get("request_id") == rid:
                return str(e["worker"])
        assert time.monotonic() < deadline, f"no 'request finished' line for {rid}"
        time.sleep(0.05)


def stream_usage(gw: Proc, text: str, key: str) -> int:
    """Cached tokens of one request on GenerateStream (the Python client) with ``key``."""
    with Client(gw.address, api_key=key) as c:
        deltas = list(c.generate(text, SamplingParams(max_tokens=4, temperature=0)))
    usage = deltas[-1].usage
    assert usage is not None
    return usage.cached_prompt_tokens


def listening(gw: Proc, field: str) -> int:
    for e in gw.log_events():
        if e.get("event") == "gateway listening":
            return int(e[field])
    raise AssertionError("the gateway logged no 'gateway listening' line")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prefix-keys") / "keys.txt"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    return path


@pytest.fixture(scope="module")
def routed(workers: list[Proc], proc_dir: Path, keys_file: Path) -> Iterator[Proc]:
    """A gateway over both workers, API keys on, cache-aware routing and scope ``key`` (defaults)."""
    g = start_gateway(workers, proc_dir, "gw-prefix", f"--api-key-file={keys_file}", "--http-port=0")
    yield g
    g.stop()


def test_a_prompt_goes_back_to_its_worker_and_reuses_its_prefix(routed: Proc, workers: list[Proc]) -> None:
    text = prompt(fresh())
    first, w1 = grpc_usage(routed, text, KEY_A)
    again, w2 = grpc_usage(routed, text, KEY_A)
    assert w1 == w2
    u0, u1 = first.final.finished.usage, again.final.finished.usage
    assert u0.cached_prompt_tokens == 0 and u1.prompt_tokens == u0.prompt_tokens > 4 * BLOCK_SIZE
    assert_reused(u1.prompt_tokens, u1.cached_prompt_tokens)
    # the workers report what they reused (tokens), and the gateway exports it per worker
    loads = {
        w.address: lo for w, lo in zip(workers, asyncio.run(worker_loads([w.address for w in workers])), strict=True)
    }
    assert loads[w1].prefix_cache_hits >= u1.cached_prompt_tokens and loads[w1].num_cached_kv_blocks > 0
    assert loads[w1].prefix_cache_queries >= loads[w1].prefix_cache_hits
    assert time.time() - 3600 < loads[w1].worker_started_at <= time.time()
    time.sleep(1.2)  # a round of load polls
    metrics = scrape_metrics(listening(routed, "metrics_port"))
    name = f'worker="{w1}"'
    assert metrics[f"draftwise_prefix_cache_hits_total{{{name}}}"] >= u1.cached_prompt_tokens
    assert metrics[f"draftwise_kv_cached_blocks{{{name}}}"] > 0


def test_distinct_prefixes_spread_and_each_finds_its_worker_again(workers: list[Proc], proc_dir: Path) -> None:
    g = start_gateway(workers, proc_dir, "gw-spread")  # a fresh routing table: no key assigned yet
    try:
        texts = [prompt(f"{fresh()}-{i}") for i in range(8)]
        placed = [grpc_usage(g, t, "") for t in texts]
        assert sorted(Counter(w for _, w in placed).values()) == [4, 4]
        for t, (_, w) in zip(texts, placed, strict=True):
            result, again = grpc_usage(g, t, "")
            assert again == w
            assert_reused(result.final.finished.usage.prompt_tokens, result.final.finished.usage.cached_prompt_tokens)
        metrics = scrape_metrics(listening(g, "metrics_port"))
        decisions = {o: metrics.get(f'draftwise_routing_decisions_total{{outcome="{o}"}}', 0) for o in OUTCOMES}
        assert decisions == {"new": 8, "hit": 8, "spill": 0, "fallback": 0}
        assert metrics["draftwise_routing_keys"] == 8
    finally:
        g.stop()


def test_openai_completions_report_cached_tokens(routed: Proc) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{listening(routed, 'http_port')}/v1", api_key=KEY_A, timeout=60)
    text = prompt(fresh())
    first = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert_reused(again.usage.prompt_tokens, again.usage.prompt_tokens_details.cached_tokens or 0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=text,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert_reused(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)
    # the same key over gRPC has the same salt: it finds the same cache
    result, _ = grpc_usage(routed, text, KEY_A)
    assert result.final.finished.usage.cached_prompt_tokens == usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("scope", ["key", "shared"])
def test_api_keys_share_a_cache_only_under_scope_shared(
    scope: str, workers: list[Proc], proc_dir: Path, keys_file: Path
) -> None:
    """One worker, so that every request lands where the first one's prefix is."""
    flags = (f"--api-key-file={keys_file}", f"--prefix-cache-scope={scope}")
    g = start_gateway(workers[:1], proc_dir, f"gw-scope-{scope}", *flags)
    try:
        text = prompt(fresh())
        first, _ = grpc_usage(g, text, KEY_A)
        assert first.final.finished.usage.cached_prompt_tokens == 0
        other, _ = grpc_usage(g, text, KEY_B)
        u = other.final.finished.usage
        if scope == "key":
            assert u.cached_prompt_tokens == 0  # another tenant's prefix is not found
            assert stream_usage(g, text, KEY_B) > 0  # but its own is (on GenerateStream too)
        else:
            assert_reused(u.prompt_tokens, u.cached_prompt_tokens)
        assert stream_usage(g, text, KEY_A) > 0
    finally:
        g.stop()


@pytest.mark.slow
def test_openai_chat_completions_report_cached_tokens(tmp_path: Path) -> None:
    model = make_chat_model(tmp_path / "chat-model")
    serve = ServeProc(tmp_path, f"--model={model}", "--http-port=0").wait_listening()
    try:
        line = said(serve.popen.stdout.readline().rstrip("\n"))
        m = re.match(r"^OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1$", line)
        assert m, f"unexpected second line {line!r}"
        port = int(m[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
        messages = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": f"task {fresh()}"}]
        kw: dict = {"model": "chat-model", "messages": messages, "max_tokens": 4, "temperature": 0}
        first = client.chat.completions.create(**kw)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = client.chat.completions.create(**kw)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert_reused(again.usage.prompt_tokens, again.usage.prompt_tokens_details.cached_tokens or 0)
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert_reused(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)
    finally:
        serve.close()


@pytest.mark.slow
def test_serve_without_prefix_caching_reuses_nothing(tmp_path: Path) -> None:
    serve = ServeProc(tmp_path, "--no-enable-prefix-caching").wait_listening()
    try:
        text = prompt(fresh())
        for _ in range(2):
            with Client(serve.address) as c:
                usage = list(c.generate(text, SamplingParams(max_tokens=4, temperature=0)))[-1].usage
            assert usage is not None and usage.prompt_tokens > 4 * BLOCK_SIZE and usage.cached_prompt_tokens == 0
        time.sleep(1.2)  # a round of load polls
        metrics = serve.metrics()
        assert metrics['draftwise_prefix_cache_queries_total{worker="worker-0"}'] == 0
        assert metrics['draftwise_kv_cached_blocks{worker="worker-0"}'] == 0
    finally:
        serve.close()
