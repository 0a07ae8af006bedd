"""Command line of the gateway (``draftwise gateway``, also ``python -m draftwise.gateway``); its
flags are shared with ``draftwise serve``. Every flag also reads ``DRAFTWISE_<FLAG>`` from the
environment (:mod:`draftwise.envflags`). The flags of GatewayConfig's fields are made from the
fields themselves (:mod:`draftwise.flagtable`: name, default, help). Workers are given by address
(``--worker``) and/or found by name (``--worker-dns``, :mod:`draftwise.gateway.discovery`)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from draftwise.envflags import apply_env, port_number
from draftwise.flagtable import Flag, add_flags, config_values, table
from draftwise.gateway.auth import load_api_keys
from draftwise.gateway.config import CACHE_SCOPES, ROUTING_POLICIES, GatewayConfig
from draftwise.gateway.discovery import Discovery, DiscoveryConfig, dns_target, read_hosts_file
from draftwise.gateway.server import Gateway, write_ready_file
from draftwise.hop import read_secret_file
from draftwise.logs import configure_logging, wrap_native_stderr

log = structlog.get_logger("draftwise.gateway")

API_KEYS_ENV = "DRAFTWISE_API_KEYS"
"""Environment variable read for API keys (comma or whitespace separated), unless --api-keys-env says another."""


GATEWAY_INTERNAL = {
    "worker_names": "draftwise serve names the workers it starts",
    "internal_secret": "read from --internal-secret-file: a secret never goes on a command line",
    "api_keys": "read from --api-key-file and the variable --api-keys-env names: keys never go on a command line",
}
"""GatewayConfig fields without a flag of their own, and why."""


def one_of(values: tuple[str, ...]) -> Callable[[str], str]:
    """A flag converter that takes one of ``values`` (argparse's error names them otherwise)."""

    def convert(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"choose one of {', '.join(values)} (got {text!r})")
        return text

    return convert


@functools.cache
def gateway_flags() -> tuple[Flag, ...]:
    """The gateway's flags, one per GatewayConfig field (but GATEWAY_INTERNAL)."""
    return table(
        GatewayConfig,
        internal=GATEWAY_INTERNAL,
        options={"workers": "--worker", "shutdown_grace_s": "--shutdown-grace"},
        converters={
            "port": port_number,
            "metrics_port": port_number,
            "http_port": port_number,
            "routing": one_of(ROUTING_POLICIES),
            "prefix_cache_scope": one_of(CACHE_SCOPES),
        },
    )


def add_gateway_args(p: argparse._ActionsContainer) -> None:
    """The gateway's flags but ``--worker`` (``draftwise gateway`` adds it; ``serve`` fills it in)."""
    add_flags(p, gateway_flags(), skip={"workers"})
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
    p.add_argument(
        "--log-format", choices=["auto", "json", "console"], default="auto", help="log lines (default: auto)"
    )
    p.add_argument("--log-level", default="info", help="debug | info | warning | error (default info)")


def config_from_args(args: argparse.Namespace, workers: tuple[str, ...]) -> GatewayConfig:
    """A GatewayConfig from parsed flags; ValueError with a readable message when they are wrong."""
    return GatewayConfig(
        **config_values(args, gateway_flags(), skip={"workers"}),
        workers=workers,
        api_keys=load_api_keys(args.api_key_file, args.api_keys_env),
        internal_secret=read_secret_file(args.internal_secret_file) if args.internal_secret_file else "",
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


def add_discovery_args(p: argparse._ActionsContainer) -> None:
    d = DiscoveryConfig()
    (workers,) = [f for f in gateway_flags() if f.name == "workers"]
    add_flags(p, [workers], helps={"workers": f"{workers.help}: host:port, repeat the flag for more"})
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
    if not args.workers and not args.worker_dns:
        p.error(
            "give workers: --worker HOST:PORT and/or --worker-dns NAME:PORT (or DRAFTWISE_WORKER / DRAFTWISE_WORKER_DNS)"
        )
    try:
        configure_logging(args.log_format, args.log_level)
        wrap_native_stderr(process="gateway")  # gRPC core's lines as JSON too, under JSON logs
        config = config_from_args(args, tuple(args.workers))
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
