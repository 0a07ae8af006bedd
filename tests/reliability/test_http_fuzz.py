"""Fuzzed bodies against the OpenAI HTTP endpoint of a real gateway and worker (issue 23): valid
requests mutated field by field (wrong types, huge and out-of-range numbers, lone surrogates,
deep nesting, NaN), bodies cut or spliced with bytes that are not UTF-8, bogus Content-Encoding
and oversized headers, over raw HTTP and through the ``openai`` SDK. With a healthy worker no
answer is a 5xx, every error is OpenAI's JSON error object, and the worker still serves after.
A seeded generator: the same 1,200 bodies every run, a few seconds of generation in all."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.http_gateway import HttpGateway, http_gateway

SEED = 23
RAW_BODIES = 1_100
SDK_BODIES = 120
PATHS = ("/v1/completions", "/v1/chat/completions")
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "ignore_eos", "skip_special_tokens", "n", "best_of", "logprobs", "top_logprobs", "stream", "stream_options",
    "echo", "suffix", "logit_bias", "response_format", "tools", "user", "x_unknown",
)  # fmt: skip
RAW_VALUES = (  # JSON text spliced in as a field's value
    "null", "true", "false", "0", "1", "-1", "2", "0.5", "-0.0", "1e308", "-1e308", "1e-320", "NaN", "Infinity",
    "-Infinity", "4294967296", "18446744073709551616", "9" * 400, "1" + "0" * 400 + ".5", "9" * 5000,
    '""', '"x"', '"\\ud800"', '"a\\udfffb"', '"\\u0000"', "[]", "{}", "[1, 2]", '["a", "\\ud800"]',
    "[4294967296]", "[-1]", "[[1, 2], [3]]", '[{"role": "user", "content": "hi"}]',
    '[{"role": "\\ud800", "content": "x"}]', '[{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]',
    '[{"role": "user", "content": [{"type": "image_url"}]}]', '{"type": "json_object"}', '{"include_usage": true}',
    "[" * 3000 + "]" * 3000, "[" * 100_000 + "]" * 100_000, '{"a": ' * 500 + "1" + "}" * 500,
)  # fmt: skip
BASES = (
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0.7, "seed": 3}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}),
)


def _mutate(rng: random.Random, body: dict) -> bytes:
    """``body`` with 1-3 fields set to raw JSON values or deleted, as bytes."""
    body = dict(body)
    raws: dict[str, str] = {}
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(FIELDS)
        if rng.random() < 0.15:
            body.pop(name, None)
            continue
        marker = f"@@{len(raws)}@@"
        raws[marker] = rng.choice(RAW_VALUES)
        body[name] = marker
    text = json.dumps(body)
    for marker, raw in raws.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode()


def _bytes_mutation(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return data[: rng.randrange(len(data) + 1)]
    if kind == 1:
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.randbytes(rng.randint(1, 8)) + data[i:]
    if kind == 2:
        return data.replace(b'"hi"', b'"\xff\xfe"').replace(b'"def f(x):"', b'"\xc3("')
    if kind == 3:
        return rng.choice([b"", b"null", b"[]", b"1", b'"x"', b"{", b"\x00" * 10, rng.randbytes(40)])
    return data


def _bodies(rng: random.Random, n: int) -> list[tuple[str, bytes, dict[str, str]]]:
    out = []
    for _ in range(n):
        path, base = rng.choice(BASES)
        if rng.random() < 0.1:
            path = rng.choice(PATHS)  # a body for the other endpoint
        data = _mutate(rng, base) if rng.random() < 0.85 else json.dumps(base).encode()
        if rng.random() < 0.2:
            data = _bytes_mutation(rng, data)
        headers: dict[str, str] = {}
        r = rng.random()
        if r < 0.04:
            headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "zstd", "x-bogus"])
        elif r < 0.06:
            headers["Content-Encoding"] = "gzip"
            data = gzip.compress(data)[: rng.randint(5, 40)]  # cut short
        elif r < 0.08:
            headers["Content-Encoding"] = "deflate"
            data = zlib.compress(data)
        elif r < 0.10:
            headers["X-Big"] = "b" * rng.choice([8_000, 9_000, 20_000])
        elif r < 0.12:
            headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "\u00e9"])
        out.append((path, data, headers))
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpGateway]:
    with http_gateway(tmp_path_factory.mktemp("httpfuzz"), "--max-in-flight=256") as s:
        yield s


def _check(status: int, headers: dict[str, str], body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:300]!r}"
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), f"{what}: {headers} {body[:300]!r}"
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{what}: {err}"


def test_fuzzed_bodies_over_raw_http(srv):
    rng = random.Random(SEED)
    bodies = _bodies(rng, RAW_BODIES)

    def one(item: tuple[str, bytes, dict[str, str]]) -> tuple[int, str]:
        path, data, headers = item
        status, h, body = srv.post(path, data, headers)
        _check(status, h, body, f"{path} {data[:200]!r} {headers}")
        return status, path

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for s, _ in pool.map(one, bodies)]
    assert len(statuses) == RAW_BODIES
    assert statuses.count(200) >= 50 and statuses.count(400) >= 500, {s: statuses.count(s) for s in set(statuses)}
    _still_serving(srv)


def test_fuzzed_bodies_through_the_openai_sdk(srv):
    rng = random.Random(SEED + 1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x", timeout=60, max_retries=0)
    # (the SDK encodes JSON as UTF-8 itself, so it cannot send a lone surrogate: raw HTTP does that above)
    values = [None, True, -1, 0, 2, 0.5, 1e308, 2**32, 2**70, 10**400, "x", "", [], {}, [4294967296], ["x", 3]]
    ok = refused = 0
    for i in range(SDK_BODIES):
        extra = {rng.choice(FIELDS[3:]): rng.choice(values) for _ in range(rng.randint(1, 3))}
        try:
            if i % 2:
                client.completions.create(
                    model="", prompt=rng.choice(["hi", "", [5, 6], [2**40]]), max_tokens=2, extra_body=extra
                )
            else:
                msgs = [{"role": rng.choice(["user", "", "x" * 100]), "content": rng.choice(["hi", ""])}]
                client.chat.completions.create(model="", messages=msgs, max_tokens=2, extra_body=extra)  # type: ignore[arg-type]
            ok += 1
        except openai.APIStatusError as e:
            assert e.status_code < 500, f"{extra}: {e.status_code} {e.response.text[:300]}"
            assert set(e.response.json()["error"]) == {"message", "type", "param", "code"}
            refused += 1
    assert ok >= 5 and refused >= 30, (ok, refused)
    _still_serving(srv)


def _still_serving(srv: HttpGateway) -> None:
    assert srv.worker.popen.poll() is None, "the worker died"
    status, _, body = srv.post_json("/v1/completions", {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body  # type: ignore[index]
    status, _, body = srv.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200, body
