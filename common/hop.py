"""The internal hop (gateway -> worker) is authenticated by a per-launch shared secret.

``draftwise serve`` makes a random secret, writes it to a file only its user can read (0600,
in a 0700 folder) and passes ``--internal-secret-file`` to its workers; its gateway sends the
secret as metadata ``draftwise-internal-secret`` on every worker call. A worker's
:class:`InternalSecretInterceptor` answers UNAUTHENTICATED to any call without it (compared
in constant time); ``grpc.health.v1.Health`` stays open for container health checks. No
torch here: the gateway imports it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog

from draftwise.wire import handler_like

log = structlog.get_logger("draftwise.hop")

SECRET_METADATA_KEY = "draftwise-internal-secret"
"""gRPC metadata key carrying the shared secret on every gateway -> worker call."""
MIN_SECRET_CHARS = 16
"""A secret file must hold at least this many characters (a generated one has 43)."""
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
"""Worker methods served without the secret (container and load-balancer health checks)."""
CLIENT_KEY_ENV_VARS = ("DRAFTWISE_API_KEYS", "DRAFTWISE_API_KEY")
"""Client API keys the workers never inherit from ``draftwise serve``'s environment."""


def generate_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def write_secret_file(path: str | os.PathLike[str], secret: str) -> Path:
    """Write ``secret`` to a new file at ``path`` that only this user can read or write (0600)."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return p


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The secret held by ``path``; ValueError (readable) when it cannot be read or is too short.
    Owner- or group-readable (0600, 0640, 0440: a Kubernetes Secret mounted for the pod's
    fsGroup is root-owned and group-readable) is fine; a file every user may read or write is
    accepted with a warning (on a shared machine keep it 0600)."""
    p = Path(path)
    try:
        text = p.read_text()
        mode = p.stat().st_mode
    except OSError as e:
        raise ValueError(f"cannot read the internal secret file {path}: {e.strerror or e}") from None
    secret = text.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the internal secret file {path} holds {len(secret)} characters; it needs at least {MIN_SECRET_CHARS}"
        )
    if mode & stat.S_IRWXO:
        log.warning(
            "the internal secret file is open to every user; chmod o-rwx it (600, or 640 for a group)",
            path=str(path),
            mode=f"{stat.S_IMODE(mode):04o}",
        )
    return secret


def secret_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata a gateway sends on every worker call (nothing without a secret)."""
    return ((SECRET_METADATA_KEY, secret),) if secret else ()


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with UNAUTHENTICATED."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return handler_like(handler, abort, handler.request_deserializer)


class InternalSecretInterceptor(grpc.aio.ServerInterceptor):
    """A worker's check: every call but health carries the launch's secret."""

    def __init__(self, secret: str) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the internal secret needs at least {MIN_SECRET_CHARS} characters")
        self._secret = secret.encode()

    def check(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """None when ``metadata`` carries the secret, else what is wrong, in words."""
        value = next((v for k, v in metadata or () if k == SECRET_METADATA_KEY), None)
        if value is None:
            return (
                f"missing {SECRET_METADATA_KEY} metadata: workers serve only their gateway "
                "(send the secret of --internal-secret-file)"
            )
        given = value if isinstance(value, bytes) else value.encode()
        return None if hmac.compare_digest(given, self._secret) else f"wrong {SECRET_METADATA_KEY}"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        problem = self.check(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        log.warning("refused a worker call", method=method, reason=problem)
        return _deny(handler, problem)
