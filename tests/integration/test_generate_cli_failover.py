"""``draftwise generate --server`` survives ``kill -9`` of the worker serving it: under a real
``draftwise serve --workers 2``, the command streams a greedy completion, the worker running
it is SIGKILLed mid-stream (found by asking each worker's GetLoad), and the command still
exits 0 having printed exactly the text of an undisturbed run: no break, nothing repeated."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from draftwise.hop import read_secret_file
from tests.integration.procs import ServeProc, child_env
from tests.integration.rpc import worker_loads

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 160
PRINTED_BEFORE_KILL = 24
"""Bytes of completion (past the prompt) the command prints before its worker is killed."""


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    s = ServeProc(tmp_path_factory.mktemp("cli-failover"), workers=2).wait_listening()
    yield s
    s.close()


def _command(serve: ServeProc) -> list[str]:
    return [sys.executable, "-m", "draftwise.cli", "generate", PROMPT, f"--max-tokens={MAX_TOKENS}", "--ignore-eos"] + [
        f"--server={serve.address}",
        "--timeout=120",
    ]


def _serving_worker(serve: ServeProc) -> tuple[str, int]:
    """Name and pid of the one worker running a request (polled until there is one)."""
    secret = read_secret_file(serve.secret_file())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ready = serve.ready_workers()
        names = sorted(ready)
        loads = asyncio.run(worker_loads([ready[n]["address"] for n in names], secret))
        busy = [n for n, lo in zip(names, loads, strict=True) if lo.num_requests_running]
        if len(busy) == 1:
            return busy[0], int(ready[busy[0]]["pid"])
        time.sleep(0.02)
    raise AssertionError("no single worker is running the request")


def test_generate_survives_kill_9_of_its_worker(serve):
    reference = subprocess.run(_command(serve), env=child_env(), capture_output=True, timeout=180)
    assert reference.returncode == 0, reference.stderr.decode()
    expected = reference.stdout
    assert len(expected) > len(PROMPT) + PRINTED_BEFORE_KILL + 50, expected

    proc = subprocess.Popen(_command(serve), env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        printed = b""
        while len(printed) < len(PROMPT) + PRINTED_BEFORE_KILL:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the command ended early: {proc.stderr.read().decode()}"
            printed += chunk
        name, pid = _serving_worker(serve)
        restarts = serve.ready_workers()[name]["restarts"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rest, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    took = time.monotonic() - killed_at
    assert proc.returncode == 0, err.decode()
    assert len(printed) < len(expected), "the request finished before its worker was killed"
    assert printed + rest == expected, f"printed {(printed + rest)!r}\nexpected {expected!r}"
    print(f"\nkilled worker {name} after {len(printed)} bytes; the command ended {took:.2f} s later")
    # the supervisor brings the killed worker back (it had nothing to do with the command's success)
    deadline = time.monotonic() + 60
    while serve.ready_workers()[name]["restarts"] == restarts:
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.1)
