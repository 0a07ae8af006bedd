"""Gateway configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GatewayConfig:
    """Everything a gateway is built from."""

    host: str = "127.0.0.1"
    """Address to listen on ("0.0.0.0" for every interface)."""
    port: int = 50051
    """Port to listen on; 0 picks a free one (see ``Gateway.port``)."""
    workers: tuple[str, ...] = ()
    """Worker addresses (host:port) serving ``draftwise.v1.WorkerService``."""
    worker_names: tuple[str, ...] = ()
    """Stable names of ``workers`` (their metrics' ``worker`` label); empty: each worker's address."""
    internal_secret: str = field(default="", repr=False)
    """Shared secret sent to the workers on every call (``draftwise.hop``); empty: none (insecure workers)."""
    max_in_flight: int = 1024
    """Requests in flight gateway-wide; past it a new request gets RESOURCE_EXHAUSTED."""
    retry_after_ms: int = 250
    """Retry hint sent with RESOURCE_EXHAUSTED (message and ``retry-after-ms`` trailing metadata)."""
    max_buffered_tokens: int = 2048
    """Tokens of one request queued for a reader that falls behind before it is cancelled (RESOURCE_EXHAUSTED)."""
    load_poll_interval_s: float = 0.5
    """How often each worker's ``GetLoad`` is polled."""
    load_timeout_s: float = 2.0
    """Deadline of a ``GetLoad`` poll; a worker that misses three in a row (or is unreachable) is taken out."""
    api_keys: frozenset[str] = frozenset()
    """Accepted API keys (``authorization: Bearer <key>``); empty: no authentication."""
    tls_cert: str | None = None
    """PEM certificate chain file; with ``tls_key``, the gateway serves TLS only."""
    tls_key: str | None = None
    """PEM private key file of ``tls_cert``."""
    metrics_port: int | None = None
    """Port of the Prometheus ``/metrics`` HTTP endpoint; None: off; 0: any free port."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint."""
    default_model: str | None = None
    """Model used when a request names none; None: the model of the first worker that answers."""
    shutdown_grace_s: float = 30.0
    """On shutdown, how long in-flight requests may run before they end with UNAVAILABLE."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_buffered_tokens < 1:
            raise ValueError(f"max_buffered_tokens must be >= 1, got {self.max_buffered_tokens}")
        if self.retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {self.retry_after_ms}")
        if self.load_poll_interval_s <= 0 or self.load_timeout_s <= 0:
            raise ValueError("load_poll_interval_s and load_timeout_s must be > 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (tls_cert) and its key (tls_key)")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.worker_names and len(self.worker_names) != len(self.workers):
            raise ValueError(f"{len(self.worker_names)} worker names for {len(self.workers)} workers")
        for what, items in (("worker address", self.workers), ("worker name", self.worker_names)):
            twice = sorted({x for x in items if items.count(x) > 1})
            if twice:
                raise ValueError(f"{what} given twice: {', '.join(twice)}")
        for address in self.workers:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {address!r}")
