"""Gateway configuration: one frozen dataclass, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_REQUEST_BYTES = (4 << 20) - (64 << 10)
"""4 MiB (gRPC's default message limit, the workers' too) minus 64 KiB of headroom for what the
gateway adds on the way to a worker (its request id, the model name)."""
MAX_RECEIVE_BYTES = 64 << 20
"""gRPC's own receive limit of the gateway: messages past it get gRPC's RESOURCE_EXHAUSTED before the
gateway sees them. ``max_request_bytes`` must stay below it."""
ROUTING_POLICIES = ("prefix", "least-loaded")
"""Values of ``GatewayConfig.routing``."""
CACHE_SCOPES = ("key", "shared")
"""Values of ``GatewayConfig.prefix_cache_scope``."""


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
    """Retry hint sent with RESOURCE_EXHAUSTED (message, ``grpc-retry-pushback-ms``/``retry-after-ms`` trailing
    metadata, a google.rpc.RetryInfo detail; ``RequestError.retry_after_ms`` on the Generate stream)."""
    max_buffered_tokens: int = 1024
    """Tokens of one request queued for a reader that falls behind before it is cancelled (RESOURCE_EXHAUSTED).
    Below the embedded model's context (2048 tokens), so that a stalled reader's long request can trip it."""
    stream_interval: int = 1
    """Output tokens a worker gathers into one delta of a streamed request after its first token (vLLM's and
    SGLang's --stream-interval): 1 sends every step's tokens as they come; more trades smoothness for less work
    per token (a delta is a message from the worker and a write to the client). Answers read whole (non-streamed
    HTTP) are gathered anyway, 32 tokens at a time (or this many, if more). At most max_buffered_tokens."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest client message accepted (bytes, serialized); larger ones get INVALID_ARGUMENT naming the
    limit. Below the internal hop's 4 MiB so that this is the limit that bites, never the hop's."""
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
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP endpoint on ``host`` (docs/openai.md); None: off; 0: any free port."""
    default_model: str | None = None
    """Model used when a request names none; None: the model of the first worker that answers."""
    shutdown_grace_s: float = 30.0
    """On shutdown, how long in-flight requests may run before they end with UNAVAILABLE."""
    max_failovers: int = 2
    """Times in a row one request may move to another worker after it sent tokens (its worker died, hung or
    drained) with no token from the worker it moved to; one more failure ends it with UNAVAILABLE (a token
    from the new worker resets the count). 0: no mid-stream failover."""
    failover_stall_s: float = 30.0
    """A worker that answers none of its GetLoad polls for this long is taken as hung: its requests move to
    another healthy worker (before or after their first token); with none, they wait on it. A worker busy
    with a long step still answers its polls, so a slow step is never a hang."""
    failover_wait_s: float = 10.0
    """How long a request that must fail over waits for a healthy worker (the supervisor restarting one),
    within its deadline, before it ends with UNAVAILABLE."""
    resume_retention_s: float = 60.0
    """How long a request whose client went away is kept, paused (no admission slot, no worker compute: its
    worker call is cancelled), with its replay buffer for a ``ResumeGeneration``, which re-admits it and goes
    on from its tokens; then it is forgotten. 0: not resumable (cancelled at once)."""
    resume_buffer_bytes: int = 1 << 20
    """Replay buffer cap of one request (serialized events); past it the request can no longer be resumed."""
    resume_buffer_total_bytes: int = 256 << 20
    """Replay buffers of all requests together; a request whose event would pass it loses resumability."""
    routing: str = "prefix"
    """How a request picks its worker: prefix (cache-aware: a prompt whose start was seen goes to the worker
    that ran it, within a load bound, so that its prefix cache is reused; new prompts go to the least-loaded
    worker) or least-loaded. See docs/serving.md."""
    prefix_routing_bytes: int = 512
    """Bytes of a prompt's start that key cache-aware routing (its text; its first token ids, 4 bytes each; its
    chat messages' roles and contents in order), with its model and cache salt."""
    prefix_routing_max_keys: int = 100_000
    """Prompt starts the cache-aware router remembers (about 150 bytes each); the least recently used go first."""
    prefix_cache_scope: str = "key"
    """Which requests may share the workers' prefix caches: key (only requests of the same API key: one tenant
    cannot learn another's prompts from the speed of its answers) or shared (every key: keys that trust each
    other, such as one application's users of a common system prompt). Without API keys every request shares."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_buffered_tokens < 1:
            raise ValueError(f"max_buffered_tokens must be >= 1, got {self.max_buffered_tokens}")
        if not 1 <= self.stream_interval <= self.max_buffered_tokens:
            raise ValueError(
                f"stream_interval must be in [1, max_buffered_tokens={self.max_buffered_tokens}], "
                f"got {self.stream_interval}"
            )
        if not 1 <= self.max_request_bytes <= MAX_RECEIVE_BYTES:
            raise ValueError(f"max_request_bytes must be in [1, {MAX_RECEIVE_BYTES}], got {self.max_request_bytes}")
        if self.retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {self.retry_after_ms}")
        if self.load_poll_interval_s <= 0 or self.load_timeout_s <= 0:
            raise ValueError("load_poll_interval_s and load_timeout_s must be > 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (tls_cert) and its key (tls_key)")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, got {self.max_failovers}")
        for name in ("failover_stall_s", "failover_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.resume_retention_s < 0:
            raise ValueError(f"resume_retention_s must be >= 0, got {self.resume_retention_s}")
        if self.resume_buffer_bytes < 0 or self.resume_buffer_total_bytes < 0:
            raise ValueError("resume_buffer_bytes and resume_buffer_total_bytes must be >= 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.prefix_cache_scope not in CACHE_SCOPES:
            raise ValueError(
                f"prefix_cache_scope must be one of {', '.join(CACHE_SCOPES)}, got {self.prefix_cache_scope!r}"
            )
        if self.prefix_routing_bytes < 1 or self.prefix_routing_max_keys < 1:
            raise ValueError("prefix_routing_bytes and prefix_routing_max_keys must be >= 1")
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
