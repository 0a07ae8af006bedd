"""Command line of the gateway (``draftwise gateway``, also ``python -m draftwise.gateway``); its
flags are shared with ``draftwise serve``. Every flag also reads ``DRAFTWISE_<FLAG>`` from the
environment (:mod:`draftwise.envflags`). Workers are given by address (``--worker``) and/or found
by name (``--worker-dns``, :mod:`draftwise.gateway.discovery`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from draftwise.envflags import apply_env, port_number
from draftwise.gateway.auth import load_api_keys
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.discovery import Discovery, DiscoveryConfig, dns_target, read_hosts_file
from draftwise.gateway.server import Gateway, write_ready_file
from draftwise.hop import read_secret_file
from draftwise.logs import configure_logging

log = structlog.get_logger("draftwise.gateway")

API_KEYS_ENV = "DRAFTWISE_API_KEYS"
"""Environment variable read for API keys (comma or whitespace separated), unless --api-keys-env says another."""


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    p.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host}; 0.0.0.0 for all)")
    p.add_argument("--port", type=port_number, default=d.port, help=f"gRPC port (default {d.port}; 0: any free port)")
    p.add_argument(
        "--max-in-flight", type=int, default=d.max_in_flight, help="requests in flight before RESOURCE_EXHAUSTED"
    )
    p.add_argument(
        "--retry-after-ms", type=int, default=d.retry_after_ms, help="retry hint sent with RESOURCE_EXHAUSTED"
    )
    p.add_argument(
        "--max-buffered-tokens",
        type=int,
        default=d.max_buffered_tokens,
        help="tokens of one request queued for a slow reader before it is cancelled with RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=d.max_request_bytes,
        help=f"largest client message accepted, in bytes (default {d.max_request_bytes}); larger: INVALID_ARGUMENT",
    )
    p.add_argument("--api-key-file", default=None, help="file of accepted API keys, one per line")
    p.add_argument(
        "--api-keys-env",
        default=API_KEYS_ENV,
        help=f"environment variable holding API keys, comma separated (default {API_KEYS_ENV}; unset: none)",
    )
    p.add_argument(
        "--internal-secret-file",
        default=None,
        help="file holding the secret the workers require (draftwise serve: default a fresh one per launch)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--metrics-port", type=port_number, default=None, help="Prometheus /metrics port (default: off; 0: any)"
    )
    p.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="OpenAI-compatible HTTP port on --host: /v1/models, /v1/completions, /v1/chat/completions "
        "(default: off; 0: any)",
    )
    p.add_argument(
        "--metrics-host", default=d.metrics_host, help=f"address of the metrics endpoint (default {d.metrics_host})"
    )
    p.add_argument(
        "--shutdown-grace", type=float, default=d.shutdown_grace_s, help="seconds in-flight requests get on shutdown"
    )
    p.add_argument(
        "--max-failovers",
        type=int,
        default=d.max_failovers,
        help=f"times a request may move to another worker mid-stream (default {d.max_failovers}; 0: never)",
    )
    p.add_argument(
        "--failover-stall-s",
        type=float,
        default=d.failover_stall_s,
        help=f"seconds without progress after which a worker call counts as hung (default {d.failover_stall_s:g})",
    )
    p.add_argument(
        "--failover-wait-s",
        type=float,
        default=d.failover_wait_s,
        help=f"seconds a failing-over request waits for a healthy worker (default {d.failover_wait_s:g})",
    )
    p.add_argument(
        "--resume-retention-s",
        type=float,
        default=d.resume_retention_s,
        help=f"seconds a request whose client went away stays resumable (default {d.resume_retention_s:g}; 0: off)",
    )
    p.add_argument(
        "--resume-buffer-bytes",
        type=int,
        default=d.resume_buffer_bytes,
        help=f"replay buffer cap per request in bytes (default {d.resume_buffer_bytes})",
    )
    p.add_argument(
        "--resume-buffer-total-bytes",
        type=int,
        default=d.resume_buffer_total_bytes,
        help=f"replay buffers of all requests together, in bytes (default {d.resume_buffer_total_bytes})",
    )
    p.add_argument(
        "--log-format", choices=["auto", "json", "console"], default="auto", help="log lines (default: auto)"
    )
    p.add_argument("--log-level", default="info", help="debug | info | warning | error (default info)")


def config_from_args(args: argparse.Namespace, workers: tuple[str, ...]) -> GatewayConfig:
    """A GatewayConfig from parsed flags; ValueError with a readable message when they are wrong."""
    return GatewayConfig(
        host=args.host,
        port=args.port,
        workers=workers,
        max_in_flight=args.max_in_flight,
        retry_after_ms=args.retry_after_ms,
        max_buffered_tokens=args.max_buffered_tokens,
        max_request_bytes=args.max_request_bytes,
        api_keys=load_api_keys(args.api_key_file, args.api_keys_env),
        internal_secret=read_secret_file(args.internal_secret_file) if args.internal_secret_file else "",
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        http_port=args.http_port,
        shutdown_grace_s=args.shutdown_grace,
        max_failovers=args.max_failovers,
        failover_stall_s=args.failover_stall_s,
        failover_wait_s=args.failover_wait_s,
        resume_retention_s=args.resume_retention_s,
        resume_buffer_bytes=args.resume_buffer_bytes,
        resume_buffer_total_bytes=args.resume_buffer_total_bytes,
    )


def run_loop(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main`` on uvloop (asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())
    return uvloop.run(main())


def install_stop_handlers(on_signal: Callable[[int], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(0.25)
    log.warning("parent process gone; stopping", parent_pid=parent_pid)
    stop.set()


async def _serve(
    config: GatewayConfig,
    ready_file: str | None,
    parent_pid: int | None = None,
    discovery_config: DiscoveryConfig | None = None,
) -> int:
    gateway = Gateway(config)
    await gateway.start()
    discovery = Discovery(gateway.router, discovery_config or DiscoveryConfig(), static=config.workers)
    await discovery.start()
    if ready_file:
        write_ready_file(ready_file, gateway.port)
    stops = 0
    stop = asyncio.Event()
    now = asyncio.Event()

    def on_signal(sig: int) -> None:
        nonlocal stops
        stops += 1
        (stop if stops == 1 else now).set()

    install_stop_handlers(on_signal)
    watcher = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid is not None else None
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await discovery.close()
    stopping = asyncio.create_task(gateway.stop())
    waiter = asyncio.create_task(now.wait())
    await asyncio.wait({stopping, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():  # a second signal: stop now
        stopping.cancel()
        await gateway.server.stop(0)
    waiter.cancel()
    return 0


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    d = DiscoveryConfig()
    p.add_argument("--worker", action="append", default=[], help="worker host:port (repeat for more)")
    p.add_argument(
        "--worker-dns",
        action="append",
        type=dns_target,
        default=[],
        help="NAME:PORT resolved periodically: every address it stands for is a worker (repeatable)",
    )
    p.add_argument(
        "--discovery-interval-s",
        type=float,
        default=d.interval_s,
        help=f"seconds between resolutions of --worker-dns (default {d.interval_s:g})",
    )
    p.add_argument(
        "--hosts-file",
        default=None,
        help="resolve --worker-dns names from this hosts-format file only, re-read every round (default: system DNS)",
    )


def build_parser(prog: str = "python -m draftwise.gateway") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="the draftwise gRPC gateway")
    add_discovery_args(p)
    p.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the parent) is gone")
    add_gateway_args(p)
    return apply_env(p)


def main(argv: list[str] | None = None, prog: str = "python -m draftwise.gateway") -> int:
    p = build_parser(prog)
    args = p.parse_args(argv)
    if not args.worker and not args.worker_dns:
        p.error(
            "give workers: --worker HOST:PORT and/or --worker-dns NAME:PORT (or DRAFTWISE_WORKER / DRAFTWISE_WORKER_DNS)"
        )
    try:
        configure_logging(args.log_format, args.log_level)
        config = config_from_args(args, tuple(args.worker))
        discovery = DiscoveryConfig(
            targets=tuple(args.worker_dns), interval_s=args.discovery_interval_s, hosts_file=args.hosts_file
        )
        if args.hosts_file is not None:
            read_hosts_file(args.hosts_file)
    except OSError as e:
        print(f"error: --hosts-file {args.hosts_file}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run_loop(lambda: _serve(config, args.ready_file, args.parent_pid, discovery))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
