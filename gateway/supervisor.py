"""The worker supervisor of ``draftwise serve``: starts the worker processes, restarts one that
died (waiting 1 s, 2 s, 4 s ... up to a cap; back to 1 s after it served stably for a while),
and gives up on one that dies while starting (a model that cannot load would crash-loop),
printing its exit status and the last lines of its stderr.

Each worker has a stable name (``worker-0``, ``worker-1``...): the gateway's router labels its
metrics with it and, when a restarted worker comes back on another port, points the name at the
new address. Workers never inherit client API keys from this process's environment.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog
from prometheus_client import Counter

from draftwise.gateway.router import Router
from draftwise.logs import announce, as_json_line, json_lines

log = structlog.get_logger("draftwise.serve")


@dataclass(frozen=True)
class RestartPolicy:
    """When a worker that died is started again."""

    backoff_initial_s: float = 1.0
    """Wait before restarting a worker that died; it doubles after each crash."""
    backoff_max_s: float = 30.0
    """The longest wait between restarts."""
    stable_after_s: float = 60.0
    """A worker that served this long before it died is restarted after ``backoff_initial_s`` again."""
    stderr_tail_lines: int = 20
    """Last lines of a worker's stderr printed with the reason when it dies."""

    def __post_init__(self) -> None:
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("restart backoff needs 0 < backoff_initial_s <= backoff_max_s")
        if self.stable_after_s < 0 or self.stderr_tail_lines < 0:
            raise ValueError("stable_after_s and stderr_tail_lines must be >= 0")


class Backoff:
    """Exponential restart delays of one worker."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._next = policy.backoff_initial_s

    def delay(self, served_s: float) -> float:
        """The wait before restarting a worker that served ``served_s`` seconds before it died."""
        if served_s >= self.policy.stable_after_s:
            self._next = self.policy.backoff_initial_s
        delay = self._next
        self._next = min(delay * 2, self.policy.backoff_max_s)
        return delay


class State(enum.Enum):
    STARTING = "starting"  # spawned, loading its model
    RUNNING = "running"  # listening (its port is known)
    WAITING = "waiting"  # died; restarted at ``restart_at``
    FAILED = "failed"  # given up


def worker_env(scrub: Sequence[str], threads: int | None, num_workers: int) -> dict[str, str]:
    """This process's environment less the variables in ``scrub`` (client API keys), with
    OMP_NUM_THREADS set (``threads``, else the cores shared out unless already set)."""
    env = {k: v for k, v in os.environ.items() if k not in scrub}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    elif "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_workers))
    return env


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "has no exit status"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


class WorkerProcess:
    """One worker slot: a name, and the process currently behind it (restarted as needed)."""

    def __init__(self, index: int, args: list[str], env: dict[str, str], ready_file: Path, tail_lines: int) -> None:
        self.index = index
        self.name = f"worker-{index}"
        self.args = args
        self.env = env
        self.ready_file = ready_file
        self.tail: collections.deque[str] = collections.deque(maxlen=max(1, tail_lines))
        self.state = State.STARTING
        self.port: int | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.backoff: Backoff | None = None
        self.started_at = self.ready_at = self.died_at = self.restart_at = 0.0
        self.restarts = 0
        self._reader: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def spawn(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.port = None
        self.tail.clear()
        self.popen = subprocess.Popen(
            [*self.args, "--ready-file", str(self.ready_file)],
            env=self.env,
            process_group=0,  # a terminal's Ctrl-C reaches only serve, which stops the workers in order
            stderr=subprocess.PIPE,
        )
        self._reader = threading.Thread(
            target=self._copy_stderr, args=(self.popen.stderr,), name=f"{self.name}-stderr", daemon=True
        )
        self._reader.start()
        self.state = State.STARTING
        self.started_at = time.monotonic()

    def _copy_stderr(self, pipe: IO[bytes]) -> None:
        """Pass the worker's stderr through to ours, keeping its last lines; under JSON logs a
        line that is not JSON (gRPC core's, a C library's, a traceback's) is passed on as a JSON
        record naming the worker."""
        out = getattr(sys.stderr, "buffer", None)
        for line in pipe:
            self.tail.append(line.decode(errors="replace").rstrip("\n"))
            if json_lines():
                line = as_json_line(line, worker=self.name)
            with contextlib.suppress(OSError, ValueError):
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    sys.stderr.write(line.decode(errors="replace"))
        pipe.close()

    def exited(self) -> bool:
        return self.popen is not None and self.popen.poll() is not None

    def poll_ready(self) -> bool:
        if self.port is None and self.ready_file.is_file():
            text = self.ready_file.read_text().strip()
            if text:
                self.port = int(text)
        return self.port is not None

    def last_lines(self) -> list[str]:
        """The last lines of the worker's stderr (all of them once it exited)."""
        if self._reader is not None and self.exited():
            self._reader.join(2.0)
        return list(self.tail)

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)


class Supervisor:
    """Starts, watches and restarts the workers of one ``draftwise serve``."""

    def __init__(
        self,
        procs: list[WorkerProcess],
        policy: RestartPolicy,
        startup_timeout_s: float,
        console: IO[str] | None = None,
    ) -> None:
        self.procs = procs
        self.policy = policy
        self.startup_timeout_s = startup_timeout_s
        self.console = console if console is not None else sys.stderr
        self.router: Router | None = None  # set once the gateway runs
        self.restart_counter: Counter | None = None  # the gateway's draftwise_worker_restarts, if it has one

    def _say(self, text: str) -> None:
        level = next((lv for lv in ("error", "warning") if text.startswith(lv)), "info")
        announce(text, self.console, level)

    def _end_progress(self, tty: bool, shown: int) -> None:
        """Clear the terminal's counting line, if one is shown."""
        if tty and shown >= 0:
            print("\r\x1b[K", end="", file=self.console, flush=True)

    # ------------------------------------------------------------------ start

    async def start(self, stop: asyncio.Event) -> int | None:
        """Start every worker and wait until each listens or was given up; None then when some
        listen, else the exit status to return (1: none started or too slow, 0: stopped)."""
        for p in self.procs:
            p.spawn()
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        n = len(self.procs)
        self._say(f"starting {n} worker{'s' * (n > 1)}: loading the model (seconds to a minute)")
        tty = self.console.isatty() and not json_lines()  # no counting line among JSON lines
        shown = -1
        while any(p.state == State.STARTING for p in self.procs):
            if stop.is_set():
                self._end_progress(tty, shown)
                return 0
            now = time.monotonic()
            if now > deadline:
                self._end_progress(tty, shown)
                self._say(f"error: the workers did not start within {self.startup_timeout_s:g} s")
                return 1
            for p in self.procs:
                was = p.state
                self._check(p, now)
                if was == State.STARTING and p.state == State.RUNNING:
                    self._end_progress(tty, shown)
                    shown = -1
                    self._say(f"{p.name} ready after {now - p.started_at:.1f} s")
            if tty and int(now - started) != shown:  # a line that counts the seconds on a terminal
                shown = int(now - started)
                ready = sum(p.state == State.RUNNING for p in self.procs)
                print(f"\rloading: {ready}/{n} ready, {shown} s", end="", file=self.console, flush=True)
            await asyncio.sleep(0.1)
        self._end_progress(tty, shown)
        running = [p for p in self.procs if p.state == State.RUNNING]
        if not running:
            return 1
        self.procs = running  # those given up at the start are not watched again
        return None

    # ------------------------------------------------------------------ watch and restart

    async def run(self, stop: asyncio.Event, poll_s: float = 0.1) -> int:
        """Watch the workers until ``stop``; 0 then, or 1 once every worker was given up."""
        while not stop.is_set():
            now = time.monotonic()
            for p in self.procs:
                self._check(p, now)
            if all(p.state == State.FAILED for p in self.procs):
                self._say("error: no worker is left (every one was given up); stopping")
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
        return 0

    def _check(self, p: WorkerProcess, now: float) -> None:
        if p.state == State.STARTING:
            if p.exited():
                self._give_up(p, f"{describe_exit(_returncode(p))} while starting")
            elif p.poll_ready():
                self._ready(p, now)
            elif now - p.started_at > self.startup_timeout_s and p.restarts:
                p.signal(signal.SIGKILL)
                assert p.popen is not None  # a starting worker has its process
                p.popen.wait()
                self._give_up(p, f"did not start within {self.startup_timeout_s:g} s")
        elif p.state == State.RUNNING:
            if p.exited():
                self._died(p, now)
        elif p.state == State.WAITING and now >= p.restart_at:
            p.restarts += 1
            if self.restart_counter is not None:
                self.restart_counter.labels(p.name).inc()
            log.info("restarting worker", worker=p.name, restarts=p.restarts)
            p.spawn()

    def _ready(self, p: WorkerProcess, now: float) -> None:
        p.state = State.RUNNING
        p.ready_at = now
        down_s = round(now - p.died_at, 2) if p.restarts else None
        log.info("worker ready", worker=p.name, address=p.address, pid=p.pid, restarts=p.restarts, down_s=down_s)
        if self.router is not None:
            self.router.replace_address(p.name, p.address)

    def _died(self, p: WorkerProcess, now: float) -> None:
        if p.backoff is None:
            p.backoff = Backoff(self.policy)
        delay = p.backoff.delay(now - p.ready_at)
        p.state, p.died_at, p.restart_at = State.WAITING, now, now + delay
        how = describe_exit(_returncode(p))
        if self.router is not None:
            self.router.report_failure(self.router.worker(p.name), f"process {how}")
        log.error(
            "worker died; restarting it",
            worker=p.name,
            pid=p.pid,
            address=p.address,
            status=_returncode(p),
            restart_in_s=delay,
            stderr_tail=p.last_lines()[-5:],
        )
        self._say(f"warning: {p.name} (pid {p.pid}) {how}; restarting it in {delay:g} s")

    def _give_up(self, p: WorkerProcess, why: str) -> None:
        p.state = State.FAILED
        if self.router is not None:
            self.router.report_failure(self.router.worker(p.name), f"given up: {why}")
        lines = p.last_lines()
        tail = "".join(f"\n  | {line}" for line in lines) if lines else " (it wrote nothing to stderr)"
        self._say(
            f"error: worker {p.index} {why}; not restarting it (it would fail the same way). Its last lines:{tail}"
        )

    # ------------------------------------------------------------------ stop

    async def stop(self, timeout: float) -> None:
        """SIGTERM every live worker, SIGKILL those still there after ``timeout`` seconds."""
        for p in self.procs:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.popen is not None and p.popen.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is None:
                log.warning("worker did not stop in time; killing it", worker=p.name, pid=p.pid)
                p.signal(signal.SIGKILL)
                p.popen.wait()


def _returncode(p: WorkerProcess) -> int | None:
    """The exit status of ``p``'s process (None: no process, or still running)."""
    return None if p.popen is None else p.popen.returncode
