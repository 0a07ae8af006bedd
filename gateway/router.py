"""Workers and routing: each worker's ``GetLoad`` is polled periodically; a request goes to
a healthy worker serving its model: with a route key (cache-aware routing,
:mod:`draftwise.gateway.prefix_routing`) the one holding its prompt's prefix within a load bound,
else the least-loaded one, counting the gateway's own in-flight requests first (they change at
once, polls lag) and the worker's queue and KV use next.

Each worker has a stable name (``worker-0``... under ``draftwise serve``, else its address)
that labels its metrics; a restarted worker may come back on another port, and
:meth:`Router.replace_address` points the same name at it. Every call to a worker carries
the internal secret (``draftwise.hop``) when the gateway has one.

Workers may also come and go while the gateway runs (``draftwise.gateway.discovery``):
:meth:`Router.add_worker` adds one, :meth:`Router.retire_worker` takes one out of rotation at
once and drops it when none of this gateway's requests runs on it any more (a live worker
finishes them; calls to a dead one fail over). ``/healthz`` on the metrics port asks
:attr:`Router.serving`."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.prefix_routing import PrefixRouting
from draftwise.hop import secret_metadata
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.wire import DRAFT_MODEL_KEY, MAX_MODEL_LEN_KEY, SPEC_METHOD_KEY, SPEC_TOKENS_KEY

log = structlog.get_logger("draftwise.gateway.router")

SLOW_POLLS_BEFORE_DOWN = 3
"""Consecutive GetLoad timeouts after which a worker that still accepts connections is taken out
(unless no other healthy worker serves its model: the last one is never taken out for being slow)."""

NOT_POLLED = "not polled yet"
"""Why a worker is down before its first poll answered."""
OLD_CHANNEL_GRACE_S = 5.0
"""After a worker's address is replaced, calls still open on the old channel get this long before it closes."""

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),  # notice a restarted worker quickly
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),  # a silently vanished worker fails its calls
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


@dataclass(eq=False)
class WorkerHandle:
    """One worker as the gateway sees it."""

    name: str  # stable across restarts: the ``worker`` label of its metrics
    address: str  # where it listens now (a restarted worker may have another port)
    channel: grpc.aio.Channel
    # WorkerService.Generate (events parsed as GenerateResponse) and GetLoad, the internal
    # secret bound in: call them as multicallables (request, timeout=...)
    generate: Callable[..., grpc.aio.UnaryStreamCall]
    get_load: Callable[..., grpc.aio.UnaryUnaryCall]
    healthy: bool = False
    model: str = ""
    max_model_len: int = 0
    # "draft" | "ngram" | "eagle" | "medusa" | "suffix" | "" (none), from GetLoad's trailing metadata
    speculative_method: str = ""
    draft_model: str = ""  # the draft model's or EAGLE/Medusa head's name; "" for ngram, suffix or none
    num_speculative_tokens: int = 0
    load: wpb.GetLoadResponse = field(default_factory=wpb.GetLoadResponse)
    in_flight: int = 0  # this gateway's requests on it
    last_error: str = NOT_POLLED
    last_poll: float = 0.0
    """Monotonic time of its last answered GetLoad (or of its (re)start, before the first answer)."""
    slow_polls: int = 0  # consecutive GetLoad timeouts
    answering: bool = True  # whether its latest GetLoad poll was answered
    retired: bool = False  # discovery no longer lists it: out of rotation, dropped once idle

    def silent_s(self, now: float) -> float:
        """Seconds since it last answered a GetLoad poll. A worker busy with a long engine step
        still answers (its gRPC front never waits on the engine); one that answers nothing (a
        stopped or hung process) grows silent."""
        return 0.0 if self.answering or not self.last_poll else now - self.last_poll

    def score(self) -> tuple[int, int, float]:
        """Lower is less loaded."""
        total = self.load.num_total_kv_blocks or 1
        return self.in_flight, self.load.num_requests_waiting, 1 - self.load.num_free_kv_blocks / total


def _connect(address: str, metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """A channel to ``address`` and its two multicallables, ``metadata`` sent on every call."""
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    generate = channel.unary_stream(
        "/draftwise.v1.WorkerService/Generate",
        request_serializer=wpb.WorkerServiceGenerateRequest.SerializeToString,
        # wire-identical to WorkerServiceGenerateResponse: no copy on the way to the client
        response_deserializer=gspb.GenerateResponse.FromString,
    )
    get_load = channel.unary_unary(
        "/draftwise.v1.WorkerService/GetLoad",
        request_serializer=wpb.GetLoadRequest.SerializeToString,
        response_deserializer=wpb.GetLoadResponse.FromString,
    )
    if metadata:
        generate = functools.partial(generate, metadata=metadata)
        get_load = functools.partial(get_load, metadata=metadata)
    return {"address": address, "channel": channel, "generate": generate, "get_load": get_load}


def worker_names(addresses: tuple[str, ...], names: tuple[str, ...]) -> tuple[str, ...]:
    """The stable names of ``addresses``: ``names`` when given (one each, unique), else the addresses."""
    if not names:
        names = addresses
    if len(names) != len(addresses):
        raise ValueError(f"{len(names)} worker names for {len(addresses)} workers")
    if len(set(names)) != len(names):
        raise ValueError(f"worker names must be unique, got {list(names)}")
    return names


class Router:
    """The worker pool: polling, health, and picking a worker per request."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        metrics: GatewayMetrics,
        poll_interval_s: float = 0.5,
        timeout_s: float = 2.0,
        on_health_change: Callable[[bool], None] | None = None,
        names: tuple[str, ...] = (),
        internal_secret: str = "",
        routing: str = "prefix",
        prefix_max_keys: int = 100_000,
    ) -> None:
        self._metadata = secret_metadata(internal_secret)
        self.workers = [
            WorkerHandle(name=n, **_connect(a, self._metadata))
            for n, a in zip(worker_names(addresses, names), addresses, strict=True)
        ]
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.on_health_change = on_health_change
        self._serving = False
        self._task: asyncio.Task[None] | None = None
        self._tiebreak = itertools.count()
        self.prefix = PrefixRouting(prefix_max_keys, metrics) if routing == "prefix" else None
        """Cache-aware routing's table (None: least-loaded routing alone)."""
        self._background: set[asyncio.Task[Any]] = set()
        self.watchers: list[Callable[[], None]] = []
        """Called after every round of polls (the gateway's hang and drain detection for its requests)."""
        self._closed = False
        metrics.health_probe = lambda: self._serving and not self._closed

    async def start(self) -> None:
        await self.poll_all()
        self._task = asyncio.create_task(self._poll_loop(), name="draftwise-router-poll")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers), return_exceptions=True)

    def worker(self, name: str) -> WorkerHandle:
        """The worker called ``name``; KeyError if there is none."""
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker named {name!r}")

    def replace_address(self, name: str, address: str) -> None:
        """Point worker ``name`` at ``address`` (it restarted, likely on another port): a new channel,
        out of rotation until its first poll, which starts at once. Calls still open on the old
        channel get OLD_CHANNEL_GRACE_S to end."""
        w = self.worker(name)
        # a new channel even on the same port: the old one may be in reconnect backoff
        old, old_address = w.channel, w.address
        for key, value in _connect(address, self._metadata).items():
            setattr(w, key, value)
        w.load = wpb.GetLoadResponse()
        w.slow_polls = 0
        w.answering, w.last_poll = True, time.monotonic()  # silent only from here on
        self._set_healthy(w, False, NOT_POLLED)
        log.info("worker address replaced", worker=name, old=old_address, new=address)
        self._spawn(old.close(OLD_CHANNEL_GRACE_S))
        self._spawn(self._poll(w))

    def add_worker(self, name: str, address: str) -> WorkerHandle:
        """Add a worker (out of rotation until its first poll answers, which starts at once).
        A retiring worker of that name is taken back instead; ValueError if one is active."""
        for w in self.workers:
            if w.name == name:
                if not w.retired:
                    raise ValueError(f"worker {name!r} is already in the pool")
                w.retired = False
                log.info("worker back in the pool", worker=name, address=w.address)
                self._spawn(self._poll(w))
                return w
        w = WorkerHandle(name=name, **_connect(address, self._metadata))
        w.last_poll = time.monotonic()
        self.workers.append(w)
        self._set_healthy(w, False, NOT_POLLED)
        log.info("worker added", worker=name, address=address)
        self._spawn(self._poll(w))
        return w

    def retire_worker(self, name: str, reason: str) -> None:
        """Take worker ``name`` out of rotation now and drop it once none of this gateway's
        requests runs on it (checked after every round of polls)."""
        w = self.worker(name)
        if w.retired:
            return
        w.retired = True
        self._set_healthy(w, False, f"retired: {reason}")
        if self.prefix is not None:
            self.prefix.forget(name, "retired")
        log.info("worker retiring", worker=name, address=w.address, reason=reason, in_flight=w.in_flight)
        self._drop_idle()

    def _drop_idle(self) -> None:
        for w in [w for w in self.workers if w.retired and w.in_flight == 0]:
            self.workers.remove(w)
            self.metrics.forget_worker(w.name)
            log.info("worker dropped", worker=w.name, address=w.address)
            self._spawn(w.channel.close(OLD_CHANNEL_GRACE_S))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_all()
            self._drop_idle()
            for watch in self.watchers:
                try:
                    watch()
                except Exception:  # a bug there must not stop the polling
                    log.exception("watcher failed")

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: WorkerHandle) -> None:
        await self._poll_once(w)
        if w not in self.workers:  # dropped meanwhile: its metrics are gone, keep them so
            self.metrics.forget_worker(w.name)

    async def _poll_once(self, w: WorkerHandle) -> None:
        channel = w.channel
        try:
            call = w.get_load(wpb.GetLoadRequest(), timeout=self.timeout_s)
            load = await call
            trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as e:
            if channel is not w.channel:  # the address changed meanwhile: this answer is stale
                return
            w.answering = False
            w.slow_polls += e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            reason = f"GetLoad failed: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                reason += " (give the gateway the workers' --internal-secret-file)"
            # unreachable: out at once; merely slow (a busy machine): out after a few misses, and
            # only while another worker can take its model's requests (never the last one)
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self._set_healthy(w, False, reason)
            elif w.slow_polls >= SLOW_POLLS_BEFORE_DOWN and w.healthy:
                if self.others_up(w):
                    self._set_healthy(w, False, reason)
                elif w.slow_polls == SLOW_POLLS_BEFORE_DOWN:
                    log.warning(
                        "worker not answering load polls; kept in rotation: no other worker serves its model",
                        worker=w.name,
                        address=w.address,
                        reason=reason,
                    )
            return
        if channel is not w.channel:
            return
        w.slow_polls = 0
        w.answering = True
        w.load = load
        w.model = load.model
        w.last_poll = time.monotonic()
        spec = {SPEC_METHOD_KEY: "", DRAFT_MODEL_KEY: "", SPEC_TOKENS_KEY: "0"}
        for key, value in trailing or ():
            if key == MAX_MODEL_LEN_KEY:
                w.max_model_len = int(value)
            elif key in spec:
                spec[key] = value if isinstance(value, str) else value.decode()
        w.speculative_method = spec[SPEC_METHOD_KEY]
        w.draft_model = spec[DRAFT_MODEL_KEY]
        w.num_speculative_tokens = int(spec[SPEC_TOKENS_KEY])
        total = load.num_total_kv_blocks or 1
        m = self.metrics
        m.kv_usage.labels(w.name).set(1 - load.num_free_kv_blocks / total)
        m.worker_running.labels(w.name).set(load.num_requests_running)
        m.worker_waiting.labels(w.name).set(load.num_requests_waiting)
        m.worker_tokens_per_second.labels(w.name).set(load.tokens_per_second)
        m.kv_cached_blocks.labels(w.name).set(load.num_cached_kv_blocks)
        m.worker_counters.values[w.name] = (load.prefix_cache_queries, load.prefix_cache_hits)
        m.worker_counters.grammar[w.name] = (
            load.constrained_requests,
            load.grammar_compile_seconds,
            load.grammar_mask_seconds,
            load.grammar_masked_steps,
        )
        if self.prefix is not None:
            self.prefix.observe_start(w.name, load.worker_started_at)
        if w.retired:
            self._set_healthy(w, False, w.last_error)
            return
        self._set_healthy(w, not load.draining, "draining" if load.draining else "")

    def _set_healthy(self, w: WorkerHandle, healthy: bool, reason: str) -> None:
        if healthy != w.healthy or (not healthy and w.last_error == NOT_POLLED):  # a change, or why it never came up
            if healthy:
                log.info("worker up", worker=w.name, address=w.address, model=w.model)
            else:
                log.warning("worker down", worker=w.name, address=w.address, reason=reason)
        w.healthy = healthy
        w.last_error = reason
        self.metrics.worker_healthy.labels(w.name).set(1 if healthy else 0)
        serving = any(x.healthy for x in self.workers)
        if serving != self._serving:
            self._serving = serving
            if self.on_health_change is not None:
                self.on_health_change(serving)

    def report_failure(self, w: WorkerHandle, reason: str) -> None:
        """A call to ``w`` failed as if it were gone: out of rotation until a poll answers."""
        self._set_healthy(w, False, reason)

    def others_up(self, w: WorkerHandle) -> bool:
        """Whether a healthy worker other than ``w`` serves ``w``'s model."""
        return any(x.healthy and x is not w and x.model == w.model for x in self.workers)

    @property
    def serving(self) -> bool:
        """Whether some worker can take a request."""
        return self._serving

    def models(self) -> dict[str, int]:
        """Models of the workers that answered at least once: {name: max_model_len}."""
        out: dict[str, int] = {}
        for w in self.workers:
            if w.model:
                out[w.model] = max(out.get(w.model, 0), w.max_model_len)
        return out

    def model_infos(self) -> dict[str, WorkerHandle]:
        """For each model, a worker serving it that answered (the one with the longest
        context): where ListModels reads its speculation settings from."""
        out: dict[str, WorkerHandle] = {}
        for w in self.workers:
            if w.model and (w.model not in out or w.max_model_len > out[w.model].max_model_len):
                out[w.model] = w
        return out

    def pick(
        self, model: str, exclude: frozenset[WorkerHandle] = frozenset(), key: bytes | None = None
    ) -> WorkerHandle | None:
        """A healthy worker serving ``model`` but those in ``exclude``, or None: for a route
        ``key``, cache-aware routing's choice (:meth:`PrefixRouting.choose`), else the least-loaded."""
        pool = [w for w in self.workers if w.healthy and w.model == model]
        candidates = [w for w in pool if w not in exclude]
        if not candidates:
            return None
        if key is not None and self.prefix is not None:
            return self.prefix.choose(key, pool, candidates)
        best = min(w.score() for w in candidates)
        tied = [w for w in candidates if w.score() == best]
        return tied[next(self._tiebreak) % len(tied)]

    def describe(self) -> str:
        """A one-line picture of the pool for error messages."""
        up = sum(w.healthy for w in self.workers)
        return f"{up} of {len(self.workers)} workers up"
