"""``draftwise serve``: N worker processes and a gateway on one machine.

The workers run ``python -m draftwise.worker.serving.server`` in their own process group (a
terminal's Ctrl-C reaches only this process, which then shuts everything down in order)
with ``--parent-pid``, so they exit by themselves if this process dies without cleaning
up. The gateway runs in this process: it imports neither torch nor the worker package.

A worker that dies is restarted with backoff, one that dies while starting is given up
(:mod:`draftwise.gateway.supervisor`); ``serve`` exits 1 only when no worker is left.
The internal hop is authenticated: a fresh secret per launch, in a file only this user can
read, passed to the workers with ``--internal-secret-file`` and sent by the gateway on every
worker call (:mod:`draftwise.hop`). Workers do not inherit client API keys.

Shutdown (Ctrl-C or SIGTERM): the gateway stops taking requests and lets in-flight ones
finish for the grace period (then ends them with UNAVAILABLE), the workers get SIGTERM,
and SIGKILL if they are still there after ``worker_stop_timeout_s``. A second Ctrl-C
skips the grace period.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.server import Gateway
from draftwise.gateway.supervisor import RestartPolicy, Supervisor, WorkerProcess, worker_env
from draftwise.hop import CLIENT_KEY_ENV_VARS, generate_secret, write_secret_file

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
    """Longest wait for every worker to load its model and listen (and for a restarted one)."""
    worker_stop_timeout_s: float = 15.0
    """After SIGTERM, how long a worker may take before it is killed."""
    log_format: str = "auto"
    """Log format of the workers (auto, json, console)."""
    log_level: str = "info"
    """Log level of the workers."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """When a worker that died is restarted."""
    internal_secret_file: str | None = None
    """Secret file given to the workers (its secret must be ``gateway.internal_secret``); None: a fresh one."""
    scrub_env: tuple[str, ...] = CLIENT_KEY_ENV_VARS
    """Environment variables the workers do not inherit (client API keys)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway (its ``workers`` are filled in with the started workers' addresses)."""


def _worker_procs(cfg: ServeConfig, tmp: Path, secret_file: Path) -> list[WorkerProcess]:
    env = worker_env(cfg.scrub_env, cfg.threads_per_worker, cfg.num_workers)
    procs = []
    for i in range(cfg.num_workers):
        # -P: the current directory stays off sys.path, so a source checkout there (whose
        # draftwise/ folder lacks the worker package) cannot shadow the installed package
        args = [sys.executable, "-P", "-m", "draftwise.worker.serving.server", "--host", "127.0.0.1", "--port", "0"]
        args += ["--internal-secret-file", str(secret_file), "--parent-pid", str(os.getpid())]
        args += ["--log-format", cfg.log_format, "--log-level", cfg.log_level, *cfg.worker_args]
        procs.append(WorkerProcess(i, args, env, tmp / f"worker-{i}.port", cfg.restart.stderr_tail_lines))
    return procs


async def serve(cfg: ServeConfig, out: object = None) -> int:
    """Run until Ctrl-C or SIGTERM; 0 after a clean shutdown, 1 when startup failed or no
    worker is left. Prints where it listens to ``out`` (stdout by default)."""
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
    if not port_problem and cfg.gateway.http_port:
        port_problem = _port_in_use(cfg.gateway.host, cfg.gateway.http_port, "--http-port")
    if port_problem:  # before the workers spend time loading the model
        print(f"error: {port_problem}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="draftwise-serve-") as tmp:  # mode 0700
        gateway_cfg = cfg.gateway
        if cfg.internal_secret_file is None:
            secret = generate_secret()
            secret_file = write_secret_file(Path(tmp) / "internal-secret", secret)  # mode 0600
            gateway_cfg = replace(gateway_cfg, internal_secret=secret)
        else:
            secret_file = Path(cfg.internal_secret_file)
        sup = Supervisor(_worker_procs(cfg, Path(tmp), secret_file), cfg.restart, cfg.startup_timeout_s)
        gateway: Gateway | None = None
        try:
            code = await sup.start(stop)
            if code is not None:
                return code
            gateway = Gateway(
                replace(
                    gateway_cfg,
                    workers=tuple(p.address for p in sup.procs),
                    worker_names=tuple(p.name for p in sup.procs),
                )
            )
            await gateway.start()
            sup.router = gateway.router
            sup.restart_counter = getattr(gateway.metrics, "worker_restarts", None)
            if not await gateway.wait_serving(30.0):
                print("error: the workers started but none answers the gateway", file=sys.stderr)
                return 1
            models = ", ".join(sorted(gateway.router.models()))
            g = cfg.gateway
            where = f"{g.host}:{gateway.port}"
            extra = (
                f"; metrics on http://{g.metrics_host}:{gateway.metrics_port}/metrics" if gateway.metrics_port else ""
            )
            n = len(sup.procs)
            print(
                f"draftwise serving {models} on {where} ({n} worker{'s' * (n > 1)}"
                f"{', TLS' if g.tls_cert else ''}{speculation_note(gateway.router)}{extra}); Ctrl-C stops",
                file=stream,
                flush=True,
            )
            if gateway.http_port is not None:
                scheme = "https" if g.tls_cert else "http"
                print(f"OpenAI-compatible HTTP on {scheme}://{g.host}:{gateway.http_port}/v1", file=stream, flush=True)
            code = await sup.run(stop)
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
            await sup.stop(0.0 if now.is_set() else cfg.worker_stop_timeout_s)
            log.info("stopped")


def speculation_note(router: object) -> str:
    """``, speculative decoding: draft <model> k<=N`` (or ``ngram k<=N``) for the serving line;
    empty when no model is served with speculation."""
    parts = []
    for w in router.model_infos().values():  # type: ignore[attr-defined]
        if w.speculative_method:
            draft = f" {w.draft_model}" if w.draft_model else ""
            parts.append(f"{w.speculative_method}{draft} k<={w.num_speculative_tokens}")
    return f", speculative decoding: {'; '.join(sorted(set(parts)))}" if parts else ""


def _port_in_use(host: str, port: int, flag: str = "--port") -> str | None:
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
            return f"cannot listen on {host}:{port}: {e.strerror} (another server there? pick one with {flag})"
    return None
