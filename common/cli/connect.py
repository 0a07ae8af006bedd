"""What the commands that talk to a running server share: the ``--server`` address, its
connection flags (API key, TLS), the ``--wait`` health poll and the hint a TLS mismatch gets."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

API_KEY_ENV = "DRAFTWISE_API_KEY"
"""Environment variable holding the API key ``generate --server`` and ``chat`` send (unless --api-key)."""
DEFAULT_SERVER_PORT = 50051
"""The port ``--server HOST`` dials when it names none (the gateway's default)."""


def server_address(text: str) -> str:
    """``--server``'s target: HOST[:PORT], or [IPv6][:PORT]; without a port, the gateway's default."""
    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address: its colons are its own
        return f"[{text}]:{DEFAULT_SERVER_PORT}"
    _host, sep, port = text.rpartition(":")
    if text.endswith("]") or not sep:
        return f"{text}:{DEFAULT_SERVER_PORT}"  # no port given
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return text


def add_connection_args(p: argparse.ArgumentParser, *, required: bool, note: str = "") -> None:
    """``--server`` and the flags of the connection to it: ``--wait``, ``--timeout``,
    ``--api-key``, ``--tls``, ``--tls-ca``. ``note`` prefixes each help (``"with --server: "``)."""
    p.add_argument(
        "--server",
        type=server_address,
        required=required,
        default=None,
        help=f"HOST[:PORT] of a running `draftwise serve` (gateway; port default {DEFAULT_SERVER_PORT})",
    )
    p.add_argument("--wait", type=float, default=0.0, help=f"{note}wait up to this many seconds for it to serve")
    p.add_argument("--timeout", type=float, default=None, help=f"{note}deadline of each request in seconds")
    p.add_argument("--api-key", default=None, help=f"{note}API key (default: ${API_KEY_ENV})")
    p.add_argument("--tls", action="store_true", help=f"{note}connect over TLS (system roots)")
    p.add_argument("--tls-ca", default=None, help=f"{note}connect over TLS trusting this PEM root certificate")


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    key = api_key(args)
    return [("authorization", f"Bearer {key}")] if key else []


def uses_tls(args: argparse.Namespace) -> bool:
    return bool(args.tls or args.tls_ca)


def tls_roots(args: argparse.Namespace) -> bytes | None:
    """The PEM roots of ``--tls-ca`` (None without it: the system's). OSError when unreadable."""
    return Path(args.tls_ca).read_bytes() if args.tls_ca else None


def tls_ca_problem(args: argparse.Namespace, e: OSError) -> str:
    return f"--tls-ca {args.tls_ca}: {e.strerror or e}"


def open_channel(args: argparse.Namespace, roots: bytes | None = None) -> Any:
    """A gRPC channel to ``--server`` (TLS with ``--tls`` or ``--tls-ca``)."""
    import grpc

    if uses_tls(args):
        return grpc.secure_channel(args.server, grpc.ssl_channel_credentials(root_certificates=roots))
    return grpc.insecure_channel(args.server)


def wait_serving(channel: object, timeout: float, metadata: list[tuple[str, str]]) -> str | None:
    """Poll the server's health until SERVING; None then, else why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0, metadata=metadata).status  # pyright: ignore[reportAttributeAccessIssue]
            if status == health_pb2.HealthCheckResponse.SERVING:
                return None
            last = f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        except grpc.RpcError as e:
            last = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        if time.monotonic() >= deadline:
            return last
        time.sleep(0.25)


def not_serving(args: argparse.Namespace, problem: str) -> str:
    """The one line ``--wait`` ends with when the server did not come up."""
    return f"{args.server} is not serving after {args.wait:g} s ({problem}){tls_hint(problem, uses_tls(args))}"


def tls_hint(problem: str, tls: bool) -> str:
    """A hint for a connection that failed the way a TLS mismatch fails: a plaintext client
    against a TLS server sees its socket closed; a TLS client against a plaintext server (or
    with the wrong CA) fails the handshake."""
    low = problem.lower()
    if not tls and ("socket closed" in low or "connection reset" in low):
        return " (if the server uses TLS, add --tls, or --tls-ca CA.pem for a private CA)"
    if tls and any(w in low for w in ("ssl", "handshake", "certificate", "tls")):
        return (
            " (the TLS handshake failed: the server may not use TLS (drop --tls/--tls-ca), or --tls-ca is not its CA)"
        )
    return ""
