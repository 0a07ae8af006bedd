"""What every request of one gateway shares: :class:`Core` (configuration, router, admission
slots, metrics, the requests in flight, the resumable ones) and :class:`InFlight`, the face
of a running request that the rest of the gateway sees (:class:`~draftwise.gateway.relay.Relay`
is its one implementation; the protocol keeps this module below it)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from draftwise.gateway.admission import Admission
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.replay import ReplayBudget
from draftwise.gateway.router import Router, WorkerHandle
from draftwise.gateway.streams import Outbox
from draftwise.gateway.tenancy import CacheSalts


class InFlight(Protocol):
    """A request the gateway is running: what the failover watch, shutdown and the client
    streams (starting, cancelling, resuming it) use of it."""

    model: str
    start_request_id: str
    """The request id it started with (what a resume with an empty request_id uses)."""
    call_worker: WorkerHandle | None
    """The worker its call in progress runs on (None between attempts)."""
    t_progress: float
    """Monotonic time of the current worker call's start or last event."""
    on_takeover: Callable[[], None] | None
    """Called when a resume on another stream takes it over (its stream forgets it)."""

    @property
    def task(self) -> asyncio.Task[None] | None: ...
    @property
    def done(self) -> bool: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def moving(self) -> bool: ...
    def move(self, reason: str, detail: str) -> None: ...
    def cancel(self, code: grpc.StatusCode = ..., message: str = ...) -> None: ...
    def client_gone(self, outbox: Outbox) -> None: ...
    def resume(self, outbox: Outbox, request_id: str, next_token_index: int) -> None: ...


@dataclass
class Core:
    """What every request of one gateway shares."""

    config: GatewayConfig
    router: Router
    admission: Admission
    metrics: GatewayMetrics
    id_prefix: str
    draining: bool = False
    relays: set[InFlight] = field(default_factory=set)
    streams: set[Any] = field(default_factory=set)  # open MultiplexedStreams
    resumable: dict[str, InFlight] = field(default_factory=dict)  # resume handle -> request
    replay_budget: ReplayBudget = field(init=False)
    salts: CacheSalts = field(init=False)
    """The cache salt of each API key (``--prefix-cache-scope``)."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        cfg = self.config
        self.replay_budget = ReplayBudget(cfg.resume_buffer_total_bytes)
        self.salts = CacheSalts(cfg.prefix_cache_scope, bool(cfg.api_keys), cfg.internal_secret)
        # read when scraped: no gauge update (a lock and a store) per relayed delta
        budget = self.replay_budget
        self.metrics.replay_bytes.set_function(lambda: budget.used)

    def worker_request_id(self) -> str:
        """A request id unique across this gateway's requests (client ids are unique per stream only)."""
        return f"{self.id_prefix}-{next(self._ids)}"

    def default_model(self) -> str | None:
        if self.config.default_model:
            return self.config.default_model
        return next((w.model for w in self.router.workers if w.model), None)
