from __future__ import annotations

import os

import draftwise  # noqa: F401 - first: it moves the checkout behind the installed packages on sys.path

# Nothing may reach a hub during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run in Triton's interpreter on CPU tensors where no GPU is present (the
# kernel tests compare them with their torch twins). Set before anything imports triton.
if os.environ.get("DRAFTWISE_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (CI runs two workers on two cores) each worker computes on one thread: two
# workers with torch's default of one thread per core oversubscribe the cores, and OpenMP's spinning
# threads then slow small ops down many times (a fixture that takes 12 s alone took 555 s so).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; subprocesses inherit it


SLOW_FOLDERS = ("reliability", "model")
"""Suites marked ``slow`` as a whole: worker kills, fuzzing and chaos (real processes, minutes),
parity with transformers (loads Hugging Face models). CI runs everything; ``pytest -m "not slow"``
runs the fast layers alone."""


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    import pytest

    for item in items:
        parts = item.path.parts
        if "tests" in parts and parts[parts.index("tests") + 1] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
