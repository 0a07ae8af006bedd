"""``draftwise generate --server`` survives ``kill -9`` of the worker serving it: under a real
``draftwise serve --workers 2``, the command streams a greedy completion, the worker running
it is SIGKILLed mid-stream (found by asking each worker's GetLoad, and SIGSTOPped at once so
that it cannot finish the request meanwhile), and the command still
exits 0 having printed exactly the text of an undisturbed run: no break, nothing repeated.
It also resumes after its connection is reset (a TCP proxy on 127.0.0.1 in between), and
gives up with exit 1 once the server cannot be reached again."""

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
from tests.integration.tcp_proxy import TcpProxy

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 450
"""Long enough (with ``--ignore-eos``; max_model_len is 512) that the request surely still
runs when a test disturbs it, on a machine several times faster than ours."""
PRINTED_BEFORE_KILL = 24
"""Bytes of completion (past the prompt) the command prints before its worker is killed."""


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    s = ServeProc(tmp_path_factory.mktemp("cli-failover"), workers=2).wait_listening()
    yield s
    s.close()


def _command(address: str) -> list[str]:
    return [sys.executable, "-m", "draftwise.cli", "generate", PROMPT, f"--max-tokens={MAX_TOKENS}", "--ignore-eos"] + [
        f"--server={address}",
        "--timeout=120",
    ]


@pytest.fixture(scope="module")
def expected(serve: ServeProc) -> bytes:
    """What an undisturbed run prints."""
    reference = subprocess.run(_command(serve.address), env=child_env(), capture_output=True, timeout=180)
    assert reference.returncode == 0, reference.stderr.decode()
    assert len(reference.stdout) > len(PROMPT) + PRINTED_BEFORE_KILL + 50, reference.stdout
    return reference.stdout


def _read_some(proc: subprocess.Popen) -> bytes:
    """The command's output until it printed PRINTED_BEFORE_KILL bytes past the prompt."""
    printed = b""
    while len(printed) < len(PROMPT) + PRINTED_BEFORE_KILL:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, f"the command ended early: {proc.stderr.read().decode()}"
        printed += chunk
    return printed


def _stop_serving_worker(serve: ServeProc) -> tuple[str, int]:
    """Name and pid of the one worker running a request (polled until there is one), which
    is SIGSTOPped right after the GetLoad that found it busy, so that it cannot finish the
    request before the caller kills it."""
    secret = read_secret_file(serve.secret_file())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready = serve.ready_workers()
        names = sorted(ready)
        loads = asyncio.run(worker_loads([ready[n]["address"] for n in names], secret))
        busy = [n for n, lo in zip(names, loads, strict=True) if lo.num_requests_running]
        if len(busy) == 1:
            pid = int(ready[busy[0]]["pid"])
            os.kill(pid, signal.SIGSTOP)
            return busy[0], pid
        time.sleep(0.02)
    raise AssertionError("no single worker is running the request")


def test_generate_survives_kill_9_of_its_worker(serve, expected):
    proc = subprocess.Popen(_command(serve.address), env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        printed = _read_some(proc)
        name, pid = _stop_serving_worker(serve)
        restarts = serve.ready_workers()[name]["restarts"]
        os.kill(pid, signal.SIGKILL)  # (a stopped process dies of SIGKILL too)
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


def test_generate_resumes_after_its_connection_is_reset(serve, expected):
    proxy = TcpProxy(serve.port)
    try:
        proc = subprocess.Popen(
            _command(proxy.address), env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        printed = _read_some(proc)
        assert proxy.drop() == 1
        rest, err = proc.communicate(timeout=180)
    finally:
        proxy.close()
    assert proc.returncode == 0, err.decode()
    assert len(printed) < len(expected)
    assert printed + rest == expected


def test_generate_gives_up_when_the_server_stays_unreachable(serve):
    proxy = TcpProxy(serve.port)
    proc = subprocess.Popen(_command(proxy.address), env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _read_some(proc)
        proxy.close()  # reset, and nobody listens there any more
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1 and err.decode().startswith("error: UNAVAILABLE"), err.decode()
    assert time.monotonic() - t0 >= 0.05 + 0.1 + 0.2 + 0.4 + 0.8  # it tried its 5 resumes first
