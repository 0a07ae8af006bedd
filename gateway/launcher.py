"""``draftwise serve``: N worker processes and a gateway on one machine.

The workers run ``python -m draftwise.worker.serving.server`` in their own process group (a
terminal's Ctrl-C reaches only this process, which then shuts everything down in order)
with ``--parent-pid``, so they exit by themselves if this process dies without cleaning
up. The gateway runs in this process: it imports neither torch nor the worker package. With
``--device cuda`` each worker gets its own GPU, or a share of one (:func:`device_plan`).

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
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

import structlog

from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.server import Gateway
from draftwise.gateway.supervisor import RestartPolicy, Supervisor, WorkerProcess, worker_env
from draftwise.hop import CLIENT_KEY_ENV_VARS, generate_secret, write_secret_file
from draftwise.logs import announce

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


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def _with_flag(args: Sequence[str], flag: str, value: str) -> tuple[str, ...]:
    """``args`` with every ``flag`` removed and ``flag value`` appended."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return (*out, flag, value)


def cuda_device_count() -> int:
    """CUDA devices a worker would see (0 without torch or CUDA). Asked of a child Python, so
    that this process (the gateway's) never imports torch; called only when a worker is to run
    on CUDA."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def device_plan(
    worker_args: Sequence[str], num_workers: int, device_count: Callable[[], int] = cuda_device_count
) -> list[tuple[str, ...]]:
    """Each worker's flags, so that workers on one machine do not all claim the same GPU.

    With ``--device cuda``, worker ``i`` runs on ``cuda:{i mod D}`` of the D devices it sees.
    Workers that share a device (more workers than devices, or an explicit ``--device cuda:N``)
    split its ``--gpu-memory-utilization`` (0.9 unless given) evenly, so that together they
    use the share one worker would have, never ``N x 0.9`` of the device. An explicit
    ``--kv-cache-memory-bytes`` or ``--num-kv-blocks`` sizes the KV cache by itself and is left
    as it is. CPU workers' flags are unchanged."""
    args = tuple(worker_args)
    device = _flag_value(args, "--device") or ""
    if not device.startswith("cuda"):
        return [args] * num_workers
    if device == "cuda":
        n = device_count()
        if n < 1:  # each worker then reports that CUDA is missing, in its own words
            return [args] * num_workers
        devices = [f"cuda:{i % n}" for i in range(num_workers)]
    else:
        devices = [device] * num_workers
    sharers = Counter(devices)
    util = float(_flag_value(args, "--gpu-memory-utilization") or 0.9)
    sized = _flag_value(args, "--kv-cache-memory-bytes") is not None or _flag_value(args, "--num-kv-blocks") is not None
    plan = []
    for d in devices:
        a = _with_flag(args, "--device", d)
        if sharers[d] > 1 and not sized:
            a = _with_flag(a, "--gpu-memory-utilization", f"{util / sharers[d]:.4f}")
        plan.append(a)
    return plan


def _worker_procs(cfg: ServeConfig, tmp: Path, secret_file: Path) -> list[WorkerProcess]:
    env = worker_env(cfg.scrub_env, cfg.threads_per_worker, cfg.num_workers)
    plan = device_plan(cfg.worker_args, cfg.num_workers)
    procs = []
    for i in range(cfg.num_workers):
        # -P: the current directory stays off sys.path, so a source checkout there (whose
        # draftwise/ folder lacks the worker package) cannot shadow the installed package
        args = [sys.executable, "-P", "-m", "draftwise.worker.serving.server", "--host", "127.0.0.1", "--port", "0"]
        args += ["--internal-secret-file", str(secret_file), "--parent-pid", str(os.getpid())]
        args += ["--log-format", cfg.log_format, "--log-level", cfg.log_level, *plan[i]]
        procs.append(WorkerProcess(i, args, env, tmp / f"worker-{i}.port", cfg.restart.stderr_tail_lines))
    return procs


async def serve(cfg: ServeConfig, out: TextIO | None = None) -> int:
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
        announce(f"error: {port_problem}", sys.stderr, "error")
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
                announce("error: the workers started but none answers the gateway", sys.stderr, "error")
                return 1
            models = ", ".join(sorted(gateway.router.models()))
            g = cfg.gateway
            where = f"{g.host}:{gateway.port}"
            extra = (
                f"; metrics on http://{g.metrics_host}:{gateway.metrics_port}/metrics" if gateway.metrics_port else ""
            )
            n = len(sup.procs)
            announce(
                f"draftwise serving {models} on {where} ({n} worker{'s' * (n > 1)}"
                f"{', TLS' if g.tls_cert else ''}{speculation_note(gateway.router)}{extra}); Ctrl-C stops",
                stream,
            )
            if gateway.http_port is not None:
                scheme = "https" if g.tls_cert else "http"
                announce(f"OpenAI-compatible HTTP on {scheme}://{g.host}:{gateway.http_port}/v1", stream)
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
    """``, speculative decoding: draft <model> k<=N`` (``eagle <head> k<=N``, ``medusa <head> k<=N``,
    ``ngram k<=N``, ``suffix k<=N``) for the serving line; empty when no model is served with speculation."""
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
