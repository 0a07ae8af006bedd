"""``draftwise health HOST:PORT``: ask a gateway or a worker ``grpc.health.v1.Health/Check``.

Exit status 0 when it answers SERVING, 1 otherwise (NOT_SERVING, unreachable, too slow, a TLS
or authentication failure), with one line saying which: a container health check
(docker-compose ``healthcheck``, a Kubernetes ``exec`` probe) for either kind of process. A
worker answers health checks without the internal secret. No torch: the gateway image runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftwise.cli.connect import server_address

DEFAULT_TIMEOUT_S = 5.0
"""Default deadline of the check, in seconds."""


def add_health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", type=server_address, help="HOST[:PORT] of a gateway or a worker (port default 50051)")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"seconds to wait (default {DEFAULT_TIMEOUT_S:g})"
    )
    p.add_argument("--service", default="", help="service name to check (default: the whole server, the empty name)")
    p.add_argument("--tls", action="store_true", help="connect over TLS (system roots)")
    p.add_argument("--tls-ca", default=None, help="connect over TLS trusting this PEM root certificate")


def check(address: str, timeout: float, service: str = "", tls: bool = False, tls_ca: str | None = None) -> str | None:
    """None when ``address`` answers SERVING within ``timeout`` seconds, else why not (one line).
    OSError when ``tls_ca`` cannot be read."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls or tls_ca:
        roots = Path(tls_ca).read_bytes() if tls_ca else None
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots))
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)  # pyright: ignore[reportAttributeAccessIssue]
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer within {timeout:g} s"
            return f"{code.name}: {e.details()}"  # type: ignore[attr-defined]
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print("error: --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        problem = check(args.address, args.timeout, args.service, args.tls, args.tls_ca)
    except OSError as e:
        print(f"error: --tls-ca {args.tls_ca}: {e.strerror or e}", file=sys.stderr)
        return 2
    if problem is None:
        print(f"{args.address}: SERVING")
        return 0
    print(f"{args.address}: {problem}", file=sys.stderr)
    return 1
