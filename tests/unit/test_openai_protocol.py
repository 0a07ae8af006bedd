"""OpenAI request bodies to ``StartGeneration`` (gateway/openai/protocol.py): what is accepted
and how it maps, and the 400 (naming the field) for everything else."""

from __future__ import annotations

import pytest

from draftwise.gateway.openai import protocol as P
from draftwise.gateway.openai.protocol import ApiError, error_body, parse_chat, parse_completion
from draftwise.v1 import generation_pb2 as pb

MSG = [{"role": "user", "content": "hi"}]


def test_completion_fields_map_to_the_contract() -> None:
    p = parse_completion(
        {
            "model": "m",
            "prompt": ["def f("],
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": -3,
            "stop": "\n",
            "logprobs": 2,
            "presence_penalty": 0.1,
            "top_k": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
        }
    )
    sp = p.start.sampling_params
    assert p.start.model == "m" and p.start.prompt.text == "def f("
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, list(sp.stop), sp.logprobs) == (
        7,
        0.5,
        0.9,
        -3,
        ["\n"],
        2,
    )
    assert sp.presence_penalty == pytest.approx(0.1) and sp.top_k == 5 and sp.ignore_eos
    assert p.stream and p.include_usage and p.logprobs


def test_completion_defaults_and_token_ids() -> None:
    p = parse_completion({"prompt": [1, 2, 3]})
    assert list(p.start.prompt.token_ids.ids) == [1, 2, 3]
    assert p.start.sampling_params.max_tokens == 16  # OpenAI's default
    assert not p.start.sampling_params.HasField("temperature") and not p.stream and not p.logprobs
    assert list(parse_completion({"prompt": [[4, 5]]}).start.prompt.token_ids.ids) == [4, 5]


def test_chat_fields_map_to_the_contract() -> None:
    p = parse_chat(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    msgs = p.start.prompt.chat.messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "ab"), ("assistant", "")]
    assert p.start.sampling_params.max_tokens == 9 and p.start.sampling_params.logprobs == 3
    unset = parse_chat({"messages": MSG})
    assert not unset.start.sampling_params.HasField("max_tokens")  # up to the context
    assert parse_chat({"messages": MSG, "logprobs": True}).start.sampling_params.logprobs == 0


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ([], None, "must be a JSON object"),
        ({"prompt": ""}, "prompt", "prompt is empty"),
        ({"prompt": ["a", 5]}, "prompt", "non-empty string or a list of token ids"),
        ({"prompt": ["a", ""]}, "prompt[1]", r"prompt\[1\] is empty"),
        ({"prompt": "a\ud800"}, "prompt", "lone surrogate"),
        ({"prompt": "x", "stop": ["a", "\udfff"]}, "stop[1]", "lone surrogate"),
        ({"prompt": "x", "temperature": 10**400}, "temperature", "must be a number"),
        ({"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
        ({"prompt": "x", "top_p": 0}, "top_p", r"in \(0, 1\]"),
        ({"prompt": "x", "stop_token_ids": [2**32]}, "stop_token_ids", "token ids"),
        ({"prompt": 5}, "prompt", "non-empty string or a list of token ids"),
        ({"prompt": [1, -2]}, "prompt", "non-negative"),
        ({"prompt": "x", "echo": True}, "echo", "echo is not supported"),
        ({"prompt": "x", "best_of": 2}, "best_of", "best_of must be 1"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
        ({"prompt": "x", "seed": 2**64}, "seed", "seed must be in"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
        ({"prompt": "x", "stop": [1]}, "stop", "string or a list of strings"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", r"in \[0, 20\]"),
        ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
        ({"prompt": "x", "model": 3}, "model", "model must be a string"),
    ],
)
def test_bad_completions(body: object, param: str | None, match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({}, "messages", "non-empty list"),
        ({"messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "non-empty string"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list of text parts"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "only text"),
        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"messages": MSG, "n": 3}, "n", "n must be 1"),
        (
            {"messages": MSG, "response_format": {"type": "yaml"}},
            "response_format.type",
            "must be .text., .json_object. or .json_schema.",
        ),
        ({"messages": MSG, "tool_choice": "auto"}, "tool_choice", "tool calling"),
    ],
)
def test_bad_chats(body: object, param: str | None, match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        parse_chat(body)
    assert err.value.status == 400 and err.value.param == param


def test_error_body_shape() -> None:
    assert error_body(429, "busy", code="rate_limit_exceeded") == {
        "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    }
    assert error_body(418, "teapot")["error"]["type"] == "server_error"


def test_usage_reports_cached_prompt_tokens() -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field) from Usage.cached_prompt_tokens;
    a batch sums them (the official SDK parsing it: tests/integration/test_prefix_cache_serving.py)."""
    u = pb.Usage(prompt_tokens=40, completion_tokens=3, cached_prompt_tokens=32)
    assert P.usage(u) == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    total = pb.Usage()
    P.add_usage(total, u)
    P.add_usage(total, pb.Usage(prompt_tokens=8, completion_tokens=1))
    assert P.usage(total)["prompt_tokens_details"] == {"cached_tokens": 32}
    assert (total.prompt_tokens, total.completion_tokens) == (48, 4)
