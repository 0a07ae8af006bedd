"""The gateway's check of sampling parameters (gateway/sampling_check.py) refuses exactly what the
worker refuses (issue 23: the gateway used to pass everything on, so a bad value got 503 while no
worker was up): seeded random parameters from edge values, each judged by both."""

from __future__ import annotations

import random

import pytest

from draftwise.gateway.sampling_check import FieldError, check_sampling
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker.serving.proto_convert import sampling_params_from_proto

FLOATS = [-1e300, -3.0, -2.0, -1.0, -1e-9, 0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 2.5, 1e300, float("nan"), float("inf")]
VALUES = {
    "temperature": FLOATS,
    "top_p": FLOATS,
    "min_p": FLOATS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "repetition_penalty": FLOATS,
    "top_k": [-(2**31), -2, -1, 0, 1, 50, 2**31 - 1],
    "max_tokens": [0, 1, 2, 16, 17, 2**32 - 1],
    "min_tokens": [0, 1, 16, 17, 2**32 - 1],
    "logprobs": [0, 1, 20, 21, 2**32 - 1],
    "stop": [["x"], [""], ["a", ""]],
    "ignore_eos": [False, True],
    # structured output: one kind of the constraint oneof (a later pick replaces an earlier one)
    "json_schema": [
        '{"type": "object"}',
        "true",
        "false",
        "",
        " \n",
        "{bad",
        "[1]",
        "3",
        "null",
        "[" * 5000,
        "x" * 300_000,
    ],
    "json_object": [True, False],
    "regex": ["[a-z]+", "", "\t", "(", "é" * 140_000],
    "grammar": ['root ::= "a"', "", "  ", "root ::= (", "a" * (256 * 1024 + 1)],
    "choice": [[], ["a"], ["a", ""], [""], ["yes", "no"], ["x"] * 1024, ["x"] * 1025, ["é" * 70_000] * 2],
}
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def _worker_refuses(sp: pb.SamplingParams, spec: pb.SpeculationOptions | None) -> bool:
    try:
        sampling_params_from_proto(sp, spec)
    except ValueError:
        return True
    return False


def test_the_gateway_refuses_what_the_worker_refuses() -> None:
    rng = random.Random(23)
    refused = constrained = 0
    for _ in range(3000):
        sp = pb.SamplingParams()
        for name in rng.sample(sorted(VALUES), rng.randint(1, 4)):
            v = rng.choice(VALUES[name])
            if name == "stop":
                sp.stop.extend(v)
            elif name == "choice":
                sp.choice.CopyFrom(pb.ChoiceConstraint(options=v))
            else:
                setattr(sp, name, v)
        spec = None
        if rng.random() < 0.3:
            methods = rng.choice([[], ["suffix"], ["draft", "ngram"], ["bogus"], ["eagle", ""], ["ngram"] * 6])
            spec = pb.SpeculationOptions(max_speculative_tokens=rng.choice([0, 1, 4]), methods=methods)
        worker = _worker_refuses(sp, spec)
        try:
            check_sampling(sp, spec)
            gateway = False
        except FieldError as e:
            gateway = True
            assert e.param in e.message or e.param == "max_speculative_tokens", e.message
        assert gateway == worker, (str(sp)[:300], spec, worker)
        refused += gateway
        constrained += sp.WhichOneof("constraint") is not None and not gateway
    assert 500 < refused < 2900  # both kinds were tried
    assert constrained > 100  # and valid constraints among them


@pytest.mark.parametrize(("params", "param"), [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p")])
def test_names_the_field(params: dict, param: str) -> None:
    with pytest.raises(FieldError) as e:
        check_sampling(pb.SamplingParams(**params))
    assert e.value.param == param


def test_the_constraint_limits_are_the_workers() -> None:
    from draftwise.gateway import sampling_check
    from draftwise.worker.sampling import constraints

    assert sampling_check.MAX_CONSTRAINT_BYTES == constraints.MAX_CONSTRAINT_BYTES
    assert sampling_check.MAX_CHOICES == constraints.MAX_CHOICES
    assert set(CONSTRAINT_KINDS) == set(constraints.KINDS)
    oneof = pb.SamplingParams.DESCRIPTOR.oneofs_by_name["constraint"]
    assert [f.name for f in oneof.fields] == list(constraints.KINDS)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"json_schema": "{bad"}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"grammar": " "}, "grammar"),
        ({"json_object": False}, "json_object"),
        ({"choice": pb.ChoiceConstraint()}, "choice"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"choice": pb.ChoiceConstraint(options=["a"]), "min_tokens": 1}, "min_tokens"),
    ],
)
def test_a_bad_constraint_names_its_field(params: dict, param: str) -> None:
    with pytest.raises(FieldError) as e:
        check_sampling(pb.SamplingParams(**params))
    assert e.value.param == param and param in e.value.message


def test_the_gateway_knows_the_workers_method_names() -> None:
    from draftwise.gateway.sampling_check import SPECULATIVE_METHOD_NAMES as gateway_names
    from draftwise.worker.core.config import LOOKUP_METHODS, SPECULATIVE_METHODS
    from draftwise.worker.sampling.sampling_params import SPECULATIVE_METHOD_NAMES as worker_names

    assert gateway_names == worker_names
    assert set(worker_names) == set(SPECULATIVE_METHODS) | set(LOOKUP_METHODS)
