"""``draftwise serve --workers N --device cuda``: each worker its own GPU, or a share of one
(``gateway/launcher.py``, ``device_plan``); never N workers each sizing for 0.9 of one device."""

from __future__ import annotations

import pytest

from draftwise.gateway.launcher import _flag_value, cuda_device_count, device_plan

BASE = ("--model", "m", "--device", "cuda")


def _devices(plan):
    return [_flag_value(a, "--device") for a in plan]


def _utils(plan):
    return [_flag_value(a, "--gpu-memory-utilization") for a in plan]


def test_one_device_each_when_there_are_enough() -> None:
    plan = device_plan(BASE, 3, lambda: 4)
    assert _devices(plan) == ["cuda:0", "cuda:1", "cuda:2"]
    assert _utils(plan) == [None, None, None]  # a device each: the default share stands
    assert all(a.count("--device") == 1 and a[:2] == ("--model", "m") for a in plan)


def test_more_workers_than_devices_share_them() -> None:
    plan = device_plan((*BASE, "--gpu-memory-utilization", "0.8"), 5, lambda: 2)
    assert _devices(plan) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    # cuda:0 holds 3 workers, cuda:1 holds 2: together they use the 0.8 one worker would
    assert _utils(plan) == ["0.2667", "0.4000", "0.2667", "0.4000", "0.2667"]
    assert all(a.count("--gpu-memory-utilization") == 1 for a in plan)


def test_an_explicit_device_is_shared_with_the_default_share() -> None:
    plan = device_plan(("--device=cuda:1",), 2, lambda: pytest.fail("no probe for an explicit device"))
    assert _devices(plan) == ["cuda:1", "cuda:1"] and _utils(plan) == ["0.4500", "0.4500"]


@pytest.mark.parametrize("sized", [("--kv-cache-memory-bytes", "1000000"), ("--num-kv-blocks", "64")])
def test_an_explicit_kv_size_is_left_alone(sized) -> None:
    plan = device_plan((*BASE, *sized), 2, lambda: 1)
    assert _devices(plan) == ["cuda:0", "cuda:0"] and _utils(plan) == [None, None]


def test_cpu_workers_and_no_cuda_keep_their_flags() -> None:
    cpu = ("--device", "cpu", "--max-model-len", "256")
    assert device_plan(cpu, 3, lambda: pytest.fail("no probe on CPU")) == [cpu] * 3
    assert device_plan(("--model", "m"), 2) == [("--model", "m")] * 2
    # cuda asked for, none there: the flags go through unchanged and each worker says why it cannot start
    assert device_plan(BASE, 2, lambda: 0) == [BASE, BASE]


def test_the_probe_runs_in_a_child_and_counts_this_machine() -> None:
    import torch

    assert cuda_device_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
