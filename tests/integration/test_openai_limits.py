"""The HTTP endpoint against a real gateway and worker (issue 23): bodies that used to be a
text/plain 500 (lone surrogates, huge integers, deep nesting, out-of-range token ids, a body that
is not what its Content-Encoding says) and headers over aiohttp's limit are a 4xx in OpenAI's JSON
shape, naming the field where there is one; prompt + max_tokens beyond the context is refused
(gRPC and HTTP) naming both numbers; a list of prompts to /v1/completions gets one choice each."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import openai
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.http_gateway import HttpGateway, http_gateway
from tests.integration.procs import MAX_MODEL_LEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = '[{"role": "user", "content": "hi"}]'
CASES = [  # (path, raw JSON body, the field OpenAI's error names)
    (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, '{"prompt": "ab", "model": "\\ud800", "max_tokens": 2}', "model"),
    (COMPLETIONS, '{"prompt": "ab", "stop": ["x", "\\udfff"], "max_tokens": 2}', "stop[1]"),
    (CHAT, '{"messages": [{"role": "us\\ud800er", "content": "hi"}]}', "messages[0].role"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (COMPLETIONS, '{"prompt": "ab", "max_tokens": ' + "9" * 5000 + "}", None),
    (COMPLETIONS, '{"prompt": "ab", "temperature": 1' + "0" * 400 + "}", "temperature"),
    (CHAT, '{"messages": ' + MSG + ', "top_p": ' + "7" * 400 + "}", "top_p"),
    (COMPLETIONS, '{"prompt": "ab", "stop_token_ids": [4294967296]}', "stop_token_ids"),
    (COMPLETIONS, '{"prompt": "ab", "stop_token_ids": [' + "1" * 30 + "]}", "stop_token_ids"),
    (COMPLETIONS, "[" * 100_000 + "]" * 100_000, None),
    (COMPLETIONS, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    (COMPLETIONS, '{"prompt": "ab", "temperature": -1}', "temperature"),
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpGateway]:
    with http_gateway(tmp_path_factory.mktemp("limits")) as s:
        yield s


def _assert_openai_error(status: int, headers: dict[str, str], body: bytes, param: str | None) -> dict:
    assert 400 <= status < 500, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), (headers, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_bodies_are_openai_4xx(srv, path, body, param):
    status, headers, data = srv.post(path, body.encode())
    _assert_openai_error(status, headers, data, param)


def test_a_body_that_is_not_gzip(srv):
    status, headers, data = srv.post(COMPLETIONS, b'{"prompt": "ab"}', {"Content-Encoding": "gzip"})
    err = _assert_openai_error(status, headers, data, None)
    assert "Content-Encoding" in err["message"]


def test_headers_over_the_limit(srv):
    status, headers, data = srv.post(COMPLETIONS, b'{"prompt": "ab"}', {"X-Big": "a" * 10_000})
    err = _assert_openai_error(status, headers, data, None)
    assert "header" in err["message"].lower()
    status, _, _ = srv.post_json(COMPLETIONS, {"prompt": "ab", "max_tokens": 2})
    assert status == 200  # still serving


def test_max_tokens_beyond_the_context_is_refused_over_http_and_grpc(srv):
    prompt = list(range(5, 15))  # 10 tokens
    for max_tokens in (MAX_MODEL_LEN - 9, 2**31):
        status, headers, body = srv.post_json(COMPLETIONS, {"prompt": prompt, "max_tokens": max_tokens})
        assert status == 400, body
        msg = body["error"]["message"]  # type: ignore[index]
        assert f"max_tokens={max_tokens}" in msg and "10 tokens" in msg and f"max_model_len={MAX_MODEL_LEN}" in msg
        with grpc.insecure_channel(srv.gateway.address) as ch:
            start = pb.StartGeneration(
                prompt=pb.Prompt(token_ids=pb.TokenIds(ids=prompt)),
                sampling_params=pb.SamplingParams(max_tokens=max_tokens),
            )
            with pytest.raises(grpc.RpcError) as e:
                list(gsgrpc.GenerateServiceStub(ch).GenerateStream(gspb.GenerateStreamRequest(start=start), timeout=30))
            assert (
                e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"max_tokens={max_tokens}" in e.value.details()
            )
    # a text prompt: only the worker knows its length in tokens (this model has no chat template)
    for max_tokens in (MAX_MODEL_LEN, 2**31):
        status, _, body = srv.post_json(COMPLETIONS, {"prompt": "def f(x):", "max_tokens": max_tokens})
        assert status == 400, body
        msg = body["error"]["message"]  # type: ignore[index]
        assert (
            f"max_tokens={max_tokens} is too large: the prompt is " in msg and f"max_model_len={MAX_MODEL_LEN}" in msg
        )
        with grpc.insecure_channel(srv.gateway.address) as ch:
            start = pb.StartGeneration(
                prompt=pb.Prompt(text="def f(x):"), sampling_params=pb.SamplingParams(max_tokens=max_tokens)
            )
            with pytest.raises(grpc.RpcError) as e:
                list(gsgrpc.GenerateServiceStub(ch).GenerateStream(gspb.GenerateStreamRequest(start=start), timeout=30))
            assert (
                e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"max_tokens={max_tokens}" in e.value.details()
            )
    status, _, body = srv.post_json(
        COMPLETIONS, {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - 10, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_MODEL_LEN - 10  # type: ignore[index]


def test_a_list_of_prompts_gets_one_choice_each(srv):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x", timeout=60)
    prompts = ["def f(x):", "import os\n", "class A:"]
    batch = client.completions.create(model="", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for p, c in zip(prompts, batch.choices, strict=True):
        one = client.completions.create(model="", prompt=p, max_tokens=4, temperature=0)
        assert c.text == one.choices[0].text and c.finish_reason == one.choices[0].finish_reason
    assert batch.usage is not None and batch.usage.completion_tokens == 12
    texts, finish, usage = ["", "", ""], [None, None, None], None
    stream = client.completions.create(
        model="", prompt=prompts, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = finish[c.index] or c.finish_reason
    assert texts == [c.text for c in batch.choices] and finish == [c.finish_reason for c in batch.choices]
    assert usage is not None and usage.completion_tokens == 12
    ids = client.completions.create(model="", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1]
    status, _, body = srv.post_json(COMPLETIONS, {"prompt": ["ok", "\ud800"], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt[1]"  # type: ignore[index]
