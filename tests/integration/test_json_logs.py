"""Under JSON logs every line a process writes to stderr is a JSON record (issue 23, defect 10):
gRPC core's own lines (written by native code straight to file descriptor 2) are wrapped by
``logs.wrap_native_stderr``, and ``draftwise serve`` wraps its workers' non-JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys

from draftwise.logs import as_json_line
from tests.integration.procs import child_env

NATIVE = """
import os, time
import grpc, structlog
from draftwise.logs import configure_logging, wrap_native_stderr
configure_logging("json", "info")
wrap_native_stderr(process="probe")
structlog.get_logger().info("python line")
os.write(2, b"E1202 04:28:03.123456  123 chttp2_transport.cc:1234] Got goaway\\n")
with grpc.insecure_channel("127.0.0.1:1") as ch:  # gRPC core logs this at info verbosity
    try:
        grpc.channel_ready_future(ch).result(timeout=1.0)
    except grpc.FutureTimeoutError:
        pass
time.sleep(0.5)  # the pump thread writes what is in the pipe
"""


def _run(code: str, **env: str) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-c", code], env={**child_env(), **env}, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return [line for line in res.stderr.splitlines() if line.strip()]


def _records(lines: list[str]) -> list[dict]:
    bad = []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            bad.append(line)
    assert not bad, bad
    return out


def test_native_stderr_lines_become_json_records() -> None:
    records = _records(_run(NATIVE, GRPC_VERBOSITY="info"))
    events = [r["event"] for r in records]
    assert "python line" in events
    goaway = [r for r in records if "Got goaway" in r["event"]]
    assert goaway and goaway[0]["level"] == "error" and goaway[0]["process"] == "probe", records
    core = [r for r in records if r.get("stream") == "stderr" and r is not goaway[0]]
    assert core, f"gRPC core wrote nothing at info verbosity: {records}"  # real native lines came through


def test_console_logs_are_left_alone() -> None:
    code = NATIVE.replace('configure_logging("json", "info")', 'configure_logging("console", "info")')
    lines = _run(code)
    assert any(line.startswith("E1202 04:28:03") for line in lines), lines  # passed through as written


def test_a_worker_line_that_is_not_json_is_wrapped() -> None:
    rec = json.loads(as_json_line(b"W1202 10:00:00.000000  7 tcp_posix.cc:1] short write\n", worker="worker-0"))
    assert rec["level"] == "warning" and rec["worker"] == "worker-0" and rec["event"].endswith("short write")
    assert as_json_line(b'{"event": "already"}\n') == b'{"event": "already"}\n'
    plain = json.loads(as_json_line(b"Traceback (most recent call last):\n"))
    assert plain["level"] == "error"
