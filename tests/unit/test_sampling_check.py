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
}


def _worker_refuses(sp: pb.SamplingParams, spec: pb.SpeculationOptions | None) -> bool:
    try:
        sampling_params_from_proto(sp, spec)
    except ValueError:
        return True
    return False


def test_the_gateway_refuses_what_the_worker_refuses() -> None:
    rng = random.Random(23)
    refused = 0
    for _ in range(3000):
        sp = pb.SamplingParams()
        for name in rng.sample(sorted(VALUES), rng.randint(1, 4)):
            v = rng.choice(VALUES[name])
            if name == "stop":
                sp.stop.extend(v)
            else:
                setattr(sp, name, v)
        spec = pb.SpeculationOptions(max_speculative_tokens=rng.choice([0, 1, 4])) if rng.random() < 0.2 else None
        worker = _worker_refuses(sp, spec)
        try:
            check_sampling(sp, spec)
            gateway = False
        except FieldError as e:
            gateway = True
            assert e.param in e.message or e.param == "max_speculative_tokens", e.message
        assert gateway == worker, (sp, spec, worker)
        refused += gateway
    assert 500 < refused < 2900  # both kinds were tried


@pytest.mark.parametrize(("params", "param"), [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p")])
def test_names_the_field(params: dict, param: str) -> None:
    with pytest.raises(FieldError) as e:
        check_sampling(pb.SamplingParams(**params))
    assert e.value.param == param
