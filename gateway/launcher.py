"""``draftwise serve``: N worker processes and a gateway on one machine.

The workers run ``python -m draftwise.worker.server`` in their own process group (a
terminal's Ctrl-C reaches only this process, which then shuts everything down in order)
with ``--parent-pid``, so they exit by themselves if this process dies without cleaning
up. The gateway runs in this process: it imports neither torch nor the worker package.

Shutdown (Ctrl-C or SIGTERM): the gateway stops taking requests and lets in-flight ones
finish for the grace period (then ends them with UNAVAILABLE), the workers get SIGTERM,
and SIGKILL if they are still there after ``worker_stop_timeout_s``. A second Ctrl-C
skips the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.server import Gateway

log = structlog.get_logger("draftwise.serve")


@dataclass(frozen=True)
class ServeConfig:
    """What ``draftwise serve`` starts."""

    num_workers: int = 1
    """Worker processes (each loads the model and runs its own engine)."""
    worker_args: tuple[str, ...] = ()
    """Extra flags for every worker (``--model``, ``--max-model-len``, ...)."""
    threads_per_worker: int | None = None
    """OMP_NUM_THREADS of each worker; None: the CPU cores shared out (unless OMP_NUM_THREADS is set)."""
    startup_timeout_s: float = 600.0
    """Longest wait for every worker to load its model and listen."""
    worker_stop_timeout_s: float = 15.0
    """After SIGTERM, how long a worker may take before it is killed."""
    log_format: str = "auto"
    """Log format of the workers (auto, json, console)."""
    log_level: str = "info"
    """Log level of the workers."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway (its ``workers`` are filled in with the started workers' addresses)."""


class WorkerProcess:
    def __init__(self, index: int, args: list[str], env: dict[str, str], ready_file: Path) -> None:
        self.index = index
        self.ready_file = ready_file
        self.popen = subprocess.Popen(args, env=env, process_group=0)
        self.port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def poll_ready(self) -> bool:
        if self.port is None and self.ready_file.is_file():
            text = self.ready_file.read_text().strip()
            if text:
                self.port = int(text)
        return self.port is not None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)


def _spawn(cfg: ServeConfig, tmp: Path) -> list[WorkerProcess]:
    env = dict(os.environ)
    if cfg.threads_per_worker is not None:
        env["OMP_NUM_THREADS"] = str(cfg.threads_per_worker)
    elif "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.num_workers))
    procs = []
    for i in range(cfg.num_workers):
        ready = tmp / f"worker-{i}.port"
        # -P: the current directory stays off sys.path, so a source checkout there (whose
        # draftwise/ folder lacks the worker package) cannot shadow the installed package
        args = [sys.executable, "-P", "-m", "draftwise.worker.server", "--host", "127.0.0.1", "--port", "0"]
        args += ["--ready-file", str(ready), "--parent-pid", str(os.getpid())]
        args += ["--log-format", cfg.log_format, "--log-level", cfg.log_level, *cfg.worker_args]
        procs.append(WorkerProcess(i, args, env, ready))
    return procs


async def _stop_workers(procs: list[WorkerProcess], timeout: float) -> None:
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.popen.poll() is None for p in procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for p in procs:
        if p.popen.poll() is None:
            log.warning("worker did not stop in time; killing it", worker=p.index, pid=p.popen.pid)
            p.signal(signal.SIGKILL)
            p.popen.wait()


async def serve(cfg: ServeConfig, out: object = None) -> int:
    """Run until Ctrl-C or SIGTERM; 0 after a clean shutdown, 1 when startup failed or every
    worker died. Prints where it listens to ``out`` (stdout by default)."""
    stream = out if out is not None else sys.stdout
    signals = 0
    stop, now = asyncio.Event(), asyncio.Event()

    def on_signal(sig: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("shutting down: in-flight requests finish first (Ctrl-C again to stop now)", signal=sig)
            stop.set()
        else:
            now.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    port_problem = _port_in_use(cfg.gateway.host, cfg.gateway.port)
    if port_problem:  # before the workers spend time loading the model
        print(f"error: {port_problem}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="draftwise-serve-") as tmp:
        procs = _spawn(cfg, Path(tmp))
        gateway: Gateway | None = None
        try:
            code = await _wait_workers(cfg, procs, stop)
            if code is not None:
                return code
            gateway = Gateway(replace(cfg.gateway, workers=tuple(p.address for p in procs)))
            await gateway.start()
            if not await gateway.wait_serving(30.0):
                print("error: the workers started but none answers the gateway", file=sys.stderr)
                return 1
            models = ", ".join(sorted(gateway.router.models()))
            g = cfg.gateway
            where = f"{g.host}:{gateway.port}"
            extra = (
                f"; metrics on http://{g.metrics_host}:{gateway.metrics_port}/metrics" if gateway.metrics_port else ""
            )
            print(
                f"draftwise serving {models} on {where} ({len(procs)} worker{'s' * (len(procs) > 1)}"
                f"{', TLS' if g.tls_cert else ''}{extra}); Ctrl-C stops",
                file=stream,
                flush=True,
            )
            code = await _run_until_stopped(procs, stop)
            stopping = asyncio.create_task(gateway.stop())
            fast = asyncio.create_task(now.wait())
            await asyncio.wait({stopping, fast}, return_when=asyncio.FIRST_COMPLETED)
            if not stopping.done():
                stopping.cancel()
                await asyncio.gather(stopping, return_exceptions=True)
                await gateway.server.stop(0)
            fast.cancel()
            return code
        finally:
            await _stop_workers(procs, 0.0 if now.is_set() else cfg.worker_stop_timeout_s)
            log.info("stopped")


def _port_in_use(host: str, port: int) -> str | None:
    """Why the gateway could not listen on host:port, or None when it can (as far as a test bind tells)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve {host}: {e}"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror} (another server there? pick one with --port)"
    return None


async def _wait_workers(cfg: ServeConfig, procs: list[WorkerProcess], stop: asyncio.Event) -> int | None:
    """None once every worker listens; else the exit status to return."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    while not all(p.poll_ready() for p in procs):
        for p in procs:
            if p.popen.poll() is not None:
                print(
                    f"error: worker {p.index} exited with status {p.popen.returncode} while starting", file=sys.stderr
                )
                return 1
        if stop.is_set():
            return 0
        if time.monotonic() > deadline:
            print(f"error: the workers did not start within {cfg.startup_timeout_s:.0f} s", file=sys.stderr)
            return 1
        await asyncio.sleep(0.1)
    return None


async def _run_until_stopped(procs: list[WorkerProcess], stop: asyncio.Event) -> int:
    """Wait for a stop signal, watching the workers; 1 if they all died first."""
    reported: set[int] = set()
    while not stop.is_set():
        for p in procs:
            if p.popen.poll() is not None and p.index not in reported:
                reported.add(p.index)
                log.error("worker exited", worker=p.index, status=p.popen.returncode, address=p.address)
        if len(reported) == len(procs):
            print("error: every worker exited; stopping", file=sys.stderr)
            return 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return 0
