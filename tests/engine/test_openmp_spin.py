"""PyTorch's OpenMP threads spin briefly (``draftwise.GOMP_SPINCOUNT``): importing draftwise before torch sets
``GOMP_SPINCOUNT`` unless the environment has it, and ``serve``'s worker processes inherit it. With libgomp's
default (300,000 pause loops of spinning after each parallel region), a prompt chunk's torch ops left a spinning thread on the
core that the kernel library's next product needed: a 256-token SmolLM2 prefill ran ~1.5x slower
(docs/benchmarks.md). What libgomp reads is the environment at the moment torch loads it, so these checks run
in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import draftwise


def _seen(code: str, *args: str, **env: str) -> str:
    """What ``code`` prints in a fresh interpreter whose environment lacks GOMP_SPINCOUNT (plus ``env``)."""
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code, *args], env={**base, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_importing_draftwise_first_sets_a_short_spin_before_torch_loads_openmp() -> None:
    code = "import draftwise, os, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert _seen(code) == draftwise.GOMP_SPINCOUNT == "10000"


def test_the_users_own_setting_wins() -> None:
    code = "import draftwise, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert _seen(code, GOMP_SPINCOUNT="300000") == "300000"


def test_nothing_is_set_once_torch_is_loaded_since_openmp_would_not_read_it() -> None:
    code = "import torch, draftwise, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert _seen(code) == "None"


def test_serves_workers_inherit_it(tmp_path) -> None:
    code = (
        "import pathlib, sys; from draftwise.gateway.launcher import ServeConfig, _worker_procs; "
        "cfg = ServeConfig(num_workers=1, worker_args=('--model', 'm'), threads_per_worker=2); "
        "t = pathlib.Path(sys.argv[1]); (proc,) = _worker_procs(cfg, t, t / 'secret'); "
        "print(proc.env.get('GOMP_SPINCOUNT'))"
    )
    assert _seen(code, str(tmp_path)) == draftwise.GOMP_SPINCOUNT
