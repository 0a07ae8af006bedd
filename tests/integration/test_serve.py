"""``draftwise serve`` and ``draftwise generate --server``: serve starts a gateway and its
workers, prints where it listens, streams completions, and on SIGTERM lets in-flight
streams finish before it exits; its workers never outlive it, even when it is killed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker import SamplingParams
from tests.integration.conftest import reference_outputs
from tests.integration.procs import ENGINE_ARGS, MODEL_NAME, ROOT, child_env
from tests.integration.rpc import Result, start, start_req


def _event(line: str) -> str:
    """What a line says: its event when it is a JSON log line (serve and its workers log JSON
    lines when not on a terminal), else the line."""
    return json.loads(line)["event"] if line.startswith("{") else line


LISTENING = re.compile(r"^draftwise serving (\S+) on 127\.0\.0\.1:(\d+) \(1 worker\); Ctrl-C stops$")


class Serve:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "draftwise.cli", "serve", "--workers=1", "--port=0", "--log-format=json"]
            + ["--shutdown-grace=30", *ENGINE_ARGS],
            stdout=subprocess.PIPE,
            stderr=open(tmp / "serve.log", "wb"),  # noqa: SIM115 - closed with the process
            env=child_env(),
            cwd=tmp,
            text=True,
        )
        self.line = self._first_line(180)
        m = LISTENING.match(_event(self.line))
        assert m, f"unexpected first line: {self.line!r}"
        self.model, self.port = m.group(1), int(m.group(2))

    def _first_line(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.popen.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.popen.kill()
            raise AssertionError("draftwise serve printed nothing")
        return self.popen.stdout.readline().rstrip("\n")

    def log(self) -> str:
        return (self.tmp / "serve.log").read_text(errors="replace")

    def workers(self) -> list[int]:
        """Pids of the worker processes started by this serve."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"draftwise.worker.serving.server" in cmd and str(self.popen.pid).encode() in cmd:
                    out.append(int(d.name))
        return out

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def _wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path)
    yield s
    s.close()


def test_serve_generate_and_graceful_sigterm(serve, reference_llm):
    assert serve.model == MODEL_NAME
    prompt = "def fibonacci(n):"
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", prompt, "--max-tokens=24"]
        + [f"--server=127.0.0.1:{serve.port}", "--wait=30"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    (ref,) = reference_outputs(reference_llm, [prompt], SamplingParams(temperature=0, max_tokens=24))
    assert res.stdout == prompt + ref.outputs[0].text + "\n"
    # while starting, serve said what was loading and when each worker was ready, in JSON lines
    # (--log-format=json) like every other line it and its workers wrote
    lines = serve.log().splitlines()
    assert json.loads(serve.line)["level"] == "info"
    not_json = [line for line in lines if not _is_json(line)]
    assert not not_json, not_json
    said = [json.loads(line)["event"] for line in lines]
    assert "starting 1 worker: loading the model (seconds to a minute)" in said, said
    assert any(re.fullmatch(r"worker-0 ready after \d+\.\d s", e) for e in said), said

    workers = serve.workers()
    assert len(workers) == 1

    async def in_flight_during_sigterm() -> tuple[Result, grpc.StatusCode]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serve.port}") as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
            await call.write(start_req(start("r", max_tokens=60, ignore_eos=True, temperature=0)))
            await call.done_writing()
            r = Result("r")
            while len(r.token_ids) < 3:
                r.add((await call.read()).event)
            serve.popen.send_signal(signal.SIGTERM)
            while (resp := await call.read()) != grpc.aio.EOF:
                r.add(resp.event)
            return r, await call.code()

    r, code = asyncio.run(in_flight_during_sigterm())
    assert r.finish_reason == pb.FINISH_REASON_LENGTH and len(r.token_ids) == 60  # it finished
    assert code == grpc.StatusCode.OK
    assert serve.popen.wait(60) == 0
    assert _wait_gone(workers, 10), "the worker outlived draftwise serve"


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_workers_do_not_outlive_a_killed_serve(serve):
    workers = serve.workers()
    assert len(workers) == 1
    serve.popen.send_signal(signal.SIGKILL)
    serve.popen.wait(10)
    assert _wait_gone(workers, 10), "the worker outlived a killed draftwise serve"


def test_generate_waits_for_a_server_and_reports_errors(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", "x", "--server=127.0.0.1:9", "--wait=0.5"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 1 and "not serving" in res.stderr and res.stderr.startswith("error: ")


def test_serve_refuses_a_taken_port_before_starting_workers(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "draftwise.cli", "serve", f"--port={port}", *ENGINE_ARGS],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    said = _event(res.stderr.strip())  # one line; JSON, as serve logs when not on a terminal
    assert res.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in said, res.stderr
    assert "pick one with --port" in said and "starting" not in res.stderr  # no worker was started


def test_serve_refuses_a_taken_http_port_before_starting_workers(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "draftwise.cli", "serve", "--port=0", f"--http-port={port}", *ENGINE_ARGS],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert res.returncode == 1, res.stderr
    said = _event(res.stderr.strip())
    assert said.startswith(f"error: cannot listen on 127.0.0.1:{port}") and "pick one with --http-port" in said
    assert "starting" not in res.stderr and "Traceback" not in res.stderr, res.stderr
