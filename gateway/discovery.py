"""Worker discovery by name: the gateway's ``--worker-dns NAME:PORT`` is resolved every
``--discovery-interval-s`` seconds (a Kubernetes headless Service, or a docker-compose service
name, answers one address per worker). An address that appears is probed with
``grpc.health.v1`` and joins the router once it answers SERVING; one that vanishes is retired
(out of rotation at once, dropped when none of this gateway's requests runs on it: a live
worker finishes them, calls to a dead one fail over). No gateway restart.

Names are resolved by the system resolver (``getaddrinfo``, off the event loop), or, with
``--hosts-file FILE``, from that file alone (``/etc/hosts`` format, re-read every round): a
deployment without DNS, and the tests, which map names to loopback addresses. A name that
does not exist resolves to no address (every worker of it retires); any other resolver failure
keeps the addresses of the previous round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwise.gateway.router import Router

log = structlog.get_logger("draftwise.gateway.discovery")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How the gateway finds workers by name."""

    targets: tuple[tuple[str, int], ...] = ()
    """(name, port) pairs resolved every round; empty: no discovery (only static workers)."""
    interval_s: float = 5.0
    """Seconds between rounds."""
    probe_timeout_s: float = 2.0
    """Deadline of the health check of an address that appeared."""
    hosts_file: str | None = None
    """Resolve from this hosts-format file only (re-read every round) instead of the system resolver."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"the discovery interval must be > 0 seconds, got {self.interval_s:g}")
        if self.probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s:g}")


def dns_target(text: str) -> tuple[str, int]:
    """An argparse type: ``NAME:PORT`` (the port is required)."""
    name, sep, port = text.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"not NAME:PORT: {text!r} (e.g. workers.draftwise.svc:50061)")
    return name.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, IPv6 addresses in brackets."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def read_hosts_file(path: str | Path) -> dict[str, list[str]]:
    """{lower-case name: [address, ...]} of a hosts-format file (``ADDRESS NAME [ALIAS...]`` lines,
    ``#`` comments). OSError when it cannot be read; ValueError naming the line when an address is bad."""
    out: dict[str, list[str]] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            address = str(ipaddress.ip_address(fields[0]))
        except ValueError:
            raise ValueError(f"{path}:{number}: not an IP address: {fields[0]!r}") from None
        if len(fields) < 2:
            raise ValueError(f"{path}:{number}: an address without a name")
        for name in fields[1:]:
            addresses = out.setdefault(name.lower(), [])
            if address not in addresses:
                addresses.append(address)
    return out


class ResolveError(Exception):
    """The resolver failed for another reason than "no such name": keep the previous answer."""


async def resolve(name: str, port: int, hosts_file: str | None = None) -> list[str]:
    """The ``host:port`` addresses ``name`` stands for now (sorted; empty when the name does not exist)."""
    if hosts_file is not None:
        try:
            hosts = read_hosts_file(hosts_file)
        except (OSError, ValueError) as e:
            raise ResolveError(f"hosts file {hosts_file}: {getattr(e, 'strerror', None) or e}") from None
        return sorted(join_host_port(a, port) for a in hosts.get(name.lower(), []))
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise ResolveError(f"resolving {name}: {e}") from None
    return sorted({join_host_port(str(info[4][0]), port) for info in infos})


async def probe(address: str, timeout: float) -> str | None:
    """None when ``address`` answers grpc.health.v1 SERVING within ``timeout``, else why not."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)  # pyright: ignore[reportAttributeAccessIssue]
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


class Discovery:
    """Keeps the router's discovered workers equal to what the names resolve to."""

    def __init__(self, router: Router, config: DiscoveryConfig, static: tuple[str, ...] = ()) -> None:
        self.router = router
        self.config = config
        self.static = frozenset(static)
        self.members: set[str] = set()
        """Discovered addresses in the router's pool now (retiring ones excluded)."""
        self._last: dict[tuple[str, int], list[str]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Run a first round now, then one every ``interval_s`` in the background."""
        if not self.config.targets:
            return
        await self.run_once()
        self._task = asyncio.create_task(self._loop(), name="draftwise-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.run_once()
            except Exception:  # a bug there must not stop discovery
                log.exception("discovery round failed")

    async def _resolve_all(self) -> set[str]:
        found: set[str] = set()
        for target in self.config.targets:
            try:
                addresses = await resolve(*target, hosts_file=self.config.hosts_file)
            except ResolveError as e:
                log.warning("worker discovery could not resolve; keeping the last answer", target=target, error=str(e))
                addresses = self._last.get(target, [])
            if addresses != self._last.get(target):
                log.info("worker discovery", name=target[0], port=target[1], addresses=addresses)
            self._last[target] = addresses
            found.update(addresses)
        return found - self.static

    async def run_once(self) -> None:
        """One round: resolve, probe and add the new addresses, retire the vanished ones."""
        found = await self._resolve_all()
        for address in sorted(self.members - found):
            self.members.discard(address)
            self.router.retire_worker(address, "no longer discovered")
        new = sorted(found - self.members)
        problems = await asyncio.gather(*(probe(a, self.config.probe_timeout_s) for a in new))
        for address, problem in zip(new, problems, strict=True):
            if problem is not None:
                log.info("discovered worker not serving yet", address=address, reason=problem)
                continue
            self.router.add_worker(address, address)
            self.members.add(address)
