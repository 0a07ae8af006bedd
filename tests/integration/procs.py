"""Real worker and gateway processes on 127.0.0.1 for the integration tests: each binds
port 0 (a port free at run time) and writes the port it got to a ready file. Workers and
gateways share one internal secret per test process (``INTERNAL_SECRET``, in a 0600 file):
call a worker directly with ``tests.integration.rpc.worker_metadata()``."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from draftwise.hop import generate_secret, write_secret_file

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "python"

MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 256
MAX_NUM_SEQS = 64
ENGINE_ARGS = (
    f"--max-model-len={MAX_MODEL_LEN}",
    f"--num-kv-blocks={NUM_KV_BLOCKS}",
    f"--max-num-seqs={MAX_NUM_SEQS}",
)
"""Small engine settings: the machine has two cores."""
ENGINE_KWARGS = {
    "max_model_len": MAX_MODEL_LEN,
    "num_kv_blocks": NUM_KV_BLOCKS,
    "max_num_seqs": MAX_NUM_SEQS,
}
"""The same settings for an in-process reference engine."""
MODEL_NAME = "draftwise-target"
"""What the workers call the embedded default model."""
PARENT = (f"--parent-pid={os.getpid()}",)
"""Children exit by themselves should the test process die without cleaning up."""
INTERNAL_SECRET = generate_secret()
"""The secret every worker started here requires and every gateway started here sends."""
_secret_file: Path | None = None


def internal_secret_file() -> Path:
    """The 0600 file holding INTERNAL_SECRET (in a 0700 folder removed at exit)."""
    global _secret_file
    if _secret_file is None:
        folder = tempfile.mkdtemp(prefix="draftwise-test-secret-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _secret_file = write_secret_file(Path(folder) / "internal-secret", INTERNAL_SECRET)
    return _secret_file


def secret_args() -> tuple[str, ...]:
    """The flag that gives a worker or gateway the tests' internal secret."""
    return (f"--internal-secret-file={internal_secret_file()}",)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Proc:
    """A child process that reports readiness by writing its port to a file."""

    def __init__(self, name: str, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.ready_file = tmp / f"{name}.port"
        self.log_file = tmp / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_file, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, *args, "--ready-file", str(self.ready_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or child_env(),
                cwd=tmp,
            )
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.is_file() and self.ready_file.read_text().strip():
                self.port = int(self.ready_file.read_text())
                return self
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_events(self) -> list[dict]:
        """The JSON log lines of the process."""
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode


def start_workers(n: int, tmp: Path, prefix: str = "worker") -> list[Proc]:
    """``n`` workers of the embedded default model, started in parallel."""
    procs = [
        Proc(
            f"{prefix}{i}",
            [
                "-m",
                "draftwise.worker.serving.server",
                "--port=0",
                "--log-format=json",
                *PARENT,
                *secret_args(),
                *ENGINE_ARGS,
            ],
            tmp,
        )
        for i in range(n)
    ]
    return all_ready(procs)


def all_ready(procs: list[Proc]) -> list[Proc]:
    """``procs`` (started together) once each is ready; all killed if one is not."""
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def start_gateway(workers: list[Proc], tmp: Path, name: str = "gateway", *flags: str, env: dict | None = None) -> Proc:
    args = ["-m", "draftwise.gateway", "--port=0", "--log-format=json", "--metrics-port=0", *PARENT, *secret_args()]
    args += flags
    for w in workers:
        args.append(f"--worker={w.address}")
    return Proc(name, args, tmp, env=env).wait_ready(30)


def metrics_port(gateway: Proc) -> int:
    for event in gateway.log_events():
        if event.get("event") == "gateway listening":
            return int(event["metrics_port"])
    raise AssertionError("the gateway logged no 'gateway listening' line")


def said(line: str) -> str:
    """What a line of ``draftwise serve`` says: the event of a JSON line (it logs JSON lines when
    not on a terminal, or with --log-format=json), else the line itself."""
    if line.startswith("{"):
        return str(json.loads(line)["event"])
    return line


LISTENING = re.compile(
    r"^draftwise serving (?P<model>\S+) on 127\.0\.0\.1:(?P<port>\d+) \((?P<workers>\d+) workers?"
    r"(?:, TLS)?(?:, speculative decoding: (?P<spec>[^;)]+))?(?:; metrics on http://[^:]+:(?P<metrics>\d+)/metrics)?\); Ctrl-C stops$"
)
"""The line ``draftwise serve`` prints once it serves."""


class ServeProc:
    """A real ``draftwise serve`` (gateway + supervised workers) on port 0, its console (stderr)
    in ``serve.log``; the JSON log lines of serve and its workers are there too."""

    def __init__(self, tmp: Path, *flags: str, workers: int = 1, env: dict[str, str] | None = None) -> None:
        self.log_file = tmp / "serve.log"
        args = [sys.executable, "-m", "draftwise.cli", "serve", f"--workers={workers}", "--port=0"]
        args += ["--log-format=json", "--metrics-port=0", *ENGINE_ARGS, *flags]
        with open(self.log_file, "wb") as log:
            self.popen = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=log, env=env or child_env(), cwd=tmp, text=True
            )
        self.port = self.metrics_port = 0
        self.model = ""

    def wait_listening(self, timeout: float = 180.0) -> ServeProc:
        sel = selectors.DefaultSelector()
        sel.register(self.popen.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.close()
            raise AssertionError(f"draftwise serve printed nothing in {timeout} s:\n{self.log()[-4000:]}")
        line = self.popen.stdout.readline().rstrip("\n")
        m = LISTENING.match(said(line))
        if not m:
            self.close()
            raise AssertionError(f"unexpected first line {line!r}:\n{self.log()[-4000:]}")
        self.model, self.port, self.metrics_port = m["model"], int(m["port"]), int(m["metrics"] or 0)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def ready_workers(self) -> dict[str, dict]:
        """The latest "worker ready" line of each worker name (pid, address, restarts, down_s)."""
        return {e["worker"]: e for e in self.log_events() if e.get("event") == "worker ready" and "restarts" in e}

    def metrics(self) -> dict[str, float]:
        """The gateway's Prometheus samples: {'name{labels}': value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def secret_file(self) -> Path:
        """The internal secret file serve gave its workers (from a worker's command line)."""
        for e in self.ready_workers().values():
            cmd = Path(f"/proc/{e['pid']}/cmdline").read_bytes().decode().split("\0")
            return Path(cmd[cmd.index("--internal-secret-file") + 1])
        raise AssertionError("no worker is ready")

    def worker_pids(self) -> set[int]:
        """Pids of the live worker processes of this serve (from /proc)."""
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().split(b"\0")
                    state = (d / "stat").read_text().split()[2]
                except OSError:
                    continue
                if b"draftwise.worker.serving.server" in cmd and str(self.popen.pid).encode() in cmd and state != "Z":
                    out.add(int(d.name))
        return out

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        with contextlib.suppress(Exception):
            self.popen.stdout.close()
