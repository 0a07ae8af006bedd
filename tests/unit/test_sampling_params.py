"""SamplingParams: vLLM's defaults, normalisation, and a ValueError naming the field for
every invalid value of every field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from draftwise.worker.sampling.sampling_params import MAX_LOGPROBS, SamplingParams

NAN, INF = math.nan, math.inf

# (field name, invalid value[, other kwargs]) -- the message must name the field.
INVALID: list[tuple[str, Any, dict[str, Any]]] = [
    ("n", 0, {}),
    ("n", -1, {}),
    ("n", 1.0, {}),
    ("n", True, {}),
    ("n", "1", {}),
    ("temperature", -1.0, {}),
    ("temperature", -1e-9, {}),
    ("temperature", NAN, {}),
    ("temperature", INF, {}),
    ("temperature", True, {}),
    ("temperature", "0.5", {}),
    ("temperature", None, {}),
    ("temperature", 10**400, {}),
    ("top_p", 0.0, {}),
    ("top_p", -0.1, {}),
    ("top_p", 1.0001, {}),
    ("top_p", NAN, {}),
    ("top_p", INF, {}),
    ("top_p", False, {}),
    ("top_k", -2, {}),
    ("top_k", 1.5, {}),
    ("top_k", 3.0, {}),
    ("top_k", True, {}),
    ("top_k", None, {}),
    ("min_p", -0.01, {}),
    ("min_p", 1.01, {}),
    ("min_p", NAN, {}),
    ("min_p", -INF, {}),
    ("min_p", True, {}),
    ("max_tokens", 0, {}),
    ("max_tokens", -5, {}),
    ("max_tokens", 16.0, {}),
    ("max_tokens", True, {}),
    ("max_tokens", "16", {}),
    ("min_tokens", -1, {}),
    ("min_tokens", 17, {}),
    ("min_tokens", 5, {"max_tokens": 4}),
    ("min_tokens", 1.0, {}),
    ("min_tokens", None, {}),
    ("min_tokens", True, {}),
    ("stop", "", {}),
    ("stop", ["ok", ""], {}),
    ("stop", [1], {}),
    ("stop", ["ok", None], {}),
    ("stop", 5, {}),
    ("stop", {"a": 1}, {}),
    ("stop_token_ids", [-1], {}),
    ("stop_token_ids", [1, 2.0], {}),
    ("stop_token_ids", [True], {}),
    ("stop_token_ids", ["3"], {}),
    ("stop_token_ids", 3, {}),
    ("stop_token_ids", "3", {}),
    ("ignore_eos", 1, {}),
    ("ignore_eos", "yes", {}),
    ("ignore_eos", None, {}),
    ("seed", 1.0, {}),
    ("seed", "42", {}),
    ("seed", True, {}),
    ("seed", 2**64, {}),
    ("seed", -(2**63) - 1, {}),
    ("presence_penalty", 2.01, {}),
    ("presence_penalty", -2.01, {}),
    ("presence_penalty", NAN, {}),
    ("presence_penalty", INF, {}),
    ("presence_penalty", True, {}),
    ("frequency_penalty", 2.5, {}),
    ("frequency_penalty", -3, {}),
    ("frequency_penalty", NAN, {}),
    ("frequency_penalty", -INF, {}),
    ("frequency_penalty", False, {}),
    ("repetition_penalty", 0.0, {}),
    ("repetition_penalty", -1.0, {}),
    ("repetition_penalty", NAN, {}),
    ("repetition_penalty", INF, {}),
    ("repetition_penalty", True, {}),
    ("logprobs", -1, {}),
    ("logprobs", MAX_LOGPROBS + 1, {}),
    ("logprobs", 2.0, {}),
    ("logprobs", True, {}),
    ("skip_special_tokens", 0, {}),
    ("skip_special_tokens", None, {}),
    ("include_stop_str_in_output", "false", {}),
    ("include_stop_str_in_output", 1, {}),
    ("use_speculation", "yes", {}),
    ("use_speculation", 0, {}),
    ("max_speculative_tokens", 0, {}),
    ("max_speculative_tokens", 2.0, {}),
    ("max_speculative_tokens", True, {}),
    ("speculative_methods", (), {}),
    ("speculative_methods", "suffix", {}),
    ("speculative_methods", ("suffix", "tree"), {}),
    ("speculative_methods", (1,), {}),
    ("constraint", "json", {}),
    ("constraint", {"kind": "xml", "value": "a"}, {}),
    ("constraint", {"kind": "regex", "value": ""}, {}),
    ("constraint", {"kind": "json_schema", "value": "{"}, {}),
    ("constraint", {"kind": "json_schema", "value": "[1]"}, {}),
    ("constraint", {"kind": "choice", "value": []}, {}),
    ("constraint", {"kind": "choice", "value": ["a", ""]}, {}),
    ("constraint", {"kind": "json_object", "value": "x"}, {}),
    ("constraint", {"kind": "json_object"}, {"ignore_eos": True}),
    ("constraint", {"kind": "json_object"}, {"min_tokens": 1}),
]


@pytest.mark.parametrize(("field", "value", "extra"), INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_value_names_the_field(field: str, value: Any, extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value, **extra})
    msg = str(e.value)
    assert field in msg, msg


def test_every_field_has_an_invalid_case() -> None:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names == {f for f, _, _ in INVALID}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": NAN}, "temperature must be a finite number >= 0, got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1, 0 (disabled) or >= 1, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 (or None), got 0"),
        ({"min_tokens": 20}, "min_tokens must be >= 0 and <= max_tokens (16), got 20"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"logprobs": 21}, "logprobs must be in [0, 20] (or None), got 21"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"stop": ["a", ""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative ints, got -3"),
    ],
)
def test_messages_state_the_allowed_range(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert expected in str(e.value)


def test_long_offending_values_are_cut_short_in_messages() -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature="x" * 10_000)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("n", [2, 5])
def test_n_above_one_is_refused_with_a_hint(n: int) -> None:
    with pytest.raises(ValueError, match=r"^n > 1 is not supported yet; send n separate requests$"):
        SamplingParams(n=n)


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert (p.ignore_eos, p.seed, p.logprobs) == (False, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (True, False)
    assert not p.is_greedy
    assert MAX_LOGPROBS == 20


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, ()),
        ("###", ("###",)),
        (["a", "bc"], ("a", "bc")),
        (("a",), ("a",)),
        ([], ()),
        (" ", (" ",)),
    ],
)
def test_stop_is_normalised_to_a_tuple(stop: Any, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids_list_becomes_tuple() -> None:
    assert SamplingParams(stop_token_ids=[2, 7]).stop_token_ids == (2, 7)
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 5e-6},
        {"temperature": 1e-5},
        {"temperature": 2.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"top_k": 100_000},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 4, "min_tokens": 4},
        {"seed": 0},
        {"seed": -1},
        {"seed": 2**64 - 1},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True},
        {"temperature": np.float32(0.5), "top_k": np.int64(3)},
    ],
)
def test_valid_values_are_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_numbers_are_normalised_to_python_types() -> None:
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=np.float32(0.5), top_k=np.int64(3))
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.presence_penalty) is float
    assert type(p.top_k) is int and p.top_k == 3


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (9.9e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy_below_1e_5(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_dict_round_trip() -> None:
    p = SamplingParams(temperature=0.3, top_k=5, stop=["x", "y"], stop_token_ids=[9], seed=7, logprobs=2)
    d = p.to_dict()
    assert d["stop"] == ["x", "y"] and d["stop_token_ids"] == [9]
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_speculative_methods_keep_their_order_without_repeats_and_round_trip() -> None:
    p = SamplingParams(speculative_methods=["suffix", "draft", "suffix"])
    assert p.speculative_methods == ("suffix", "draft")
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams().speculative_methods is None
