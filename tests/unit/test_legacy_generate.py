"""vLLM's legacy ``POST /generate`` bodies, checked (gateway/openai/legacy_generate.py): the prompt,
``stream``, the sampling fields under vLLM's names with vLLM's defaults, and a 400 naming the
field for anything unknown, beam search, ``n`` past 1 or a bad value."""

from __future__ import annotations

import pytest

from draftwise.gateway.openai.api_error import ApiError
from draftwise.gateway.openai.legacy_generate import DEFAULT_MAX_TOKENS, SAMPLING_FIELDS, parse_generate


def _refused(body: object) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_generate(body)
    assert e.value.status == 400 and "\n" not in e.value.message
    return e.value


def test_the_articles_request() -> None:
    body = {"prompt": "San Francisco is a", "max_tokens": 512, "temperature": 0.7, "use_beam_search": False}
    parsed = parse_generate(body)
    assert parsed.prompt == "San Francisco is a" and not parsed.stream
    start = parsed.start
    assert start.prompt.text == "San Francisco is a" and start.model == ""  # the server's default model
    sp = start.sampling_params
    assert sp.max_tokens == 512 and sp.temperature == pytest.approx(0.7)


def test_vllms_defaults() -> None:
    parsed = parse_generate({"prompt": "x", "stream": True})
    sp = parsed.start.sampling_params
    assert parsed.stream and sp.max_tokens == DEFAULT_MAX_TOKENS == 16
    assert not sp.HasField("temperature")  # unset: 1.0, as vLLM's SamplingParams


def test_every_sampling_field() -> None:
    body = {
        "prompt": "x",
        "stream": False,
        "n": 1,
        "best_of": None,
        "use_beam_search": False,
        "max_tokens": 8,
        "min_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "skip_special_tokens": False,
    }
    assert set(body) == {"prompt", "stream", *SAMPLING_FIELDS}
    sp = parse_generate(body).start.sampling_params
    assert (sp.max_tokens, sp.min_tokens, sp.top_k, sp.seed, list(sp.stop), list(sp.stop_token_ids)) == (
        8,
        2,
        40,
        7,
        ["\n\n"],
        [2],
    )
    assert sp.ignore_eos and not sp.skip_special_tokens
    assert (sp.top_p, sp.min_p, sp.repetition_penalty) == pytest.approx((0.9, 0.05, 1.1))
    assert parse_generate({"prompt": "x", "stop": "END"}).start.sampling_params.stop == ["END"]


def test_unknown_fields_are_named() -> None:
    e = _refused({"prompt": "x", "logits_processors": [], "best_of_n": 2})
    assert e.param == "best_of_n"
    assert e.message.startswith("unknown fields 'best_of_n', 'logits_processors': /generate takes prompt, stream")
    assert _refused({"prompt": "x", "model": "m"}).message.startswith("unknown field 'model':")


def test_beam_search_is_refused_clearly() -> None:
    e = _refused({"prompt": "x", "use_beam_search": True, "n": 4})
    assert e.param == "use_beam_search" and "beam search is not supported" in e.message
    assert _refused({"prompt": "x", "use_beam_search": "yes"}).param == "use_beam_search"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "\ud800"}, "prompt"),
    ],
)
def test_bad_values_name_their_field(body: dict[str, object], param: str) -> None:
    assert _refused(body).param == param


@pytest.mark.parametrize("body", [None, [], "prompt", 3, ["x"]])
def test_a_body_that_is_not_an_object(body: object) -> None:
    assert _refused(body).message.startswith("the request body must be a JSON object")
