"""Prometheus metrics of the gateway, on their own registry, served over HTTP from a thread
(nothing here touches the event loop): ``/metrics`` (Prometheus' text format), ``/healthz``
(200 ``ok`` while at least one worker serves, 503 otherwise: a load balancer's or an orchestrator's
HTTP check) and 404 for every other path."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler
from prometheus_client.registry import Collector

from draftwise.v1 import generation_pb2 as pb

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_RATIO_BUCKETS = tuple(i / 10 for i in range(11))


class WorkerCounters(Collector):
    """Per-worker lifetime counters the workers keep themselves (their GetLoad answers), exported
    as Prometheus counters as last polled (a worker's restart starts them again from 0, which
    Prometheus' ``rate`` reads as a counter reset)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[int, int]] = {}
        """worker name -> (prefix cache queries, prefix cache hits), in tokens."""
        self.grammar: dict[str, tuple[int, float, float, int]] = {}
        """worker name -> (constrained requests, compile seconds, mask seconds, masked steps)."""

    def collect(self) -> Iterable[CounterMetricFamily]:
        queries = CounterMetricFamily(
            "draftwise_prefix_cache_queries",
            "Prompt tokens a worker looked up in its prefix cache (vLLM's prefix_cache_queries)",
            labels=["worker"],
        )
        hits = CounterMetricFamily(
            "draftwise_prefix_cache_hits",
            "Prompt tokens a worker found in its prefix cache (vLLM's prefix_cache_hits)",
            labels=["worker"],
        )
        for name, (q, h) in sorted(list(self.values.items())):  # (a copy: polls update it on the event loop)
            queries.add_metric([name], q)
            hits.add_metric([name], h)
        grammar = [
            CounterMetricFamily(
                "draftwise_constrained_requests", "Constrained requests a worker took", labels=["worker"]
            ),
            CounterMetricFamily(
                "draftwise_grammar_compile_seconds",
                "Seconds a worker spent compiling constraints (each distinct one once)",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "draftwise_grammar_mask_seconds",
                "Seconds a worker spent filling and applying constraint masks (per step: rate over "
                "draftwise_grammar_masked_steps)",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "draftwise_grammar_masked_steps", "Engine steps that masked rows with a constraint", labels=["worker"]
            ),
        ]
        for name, values in sorted(list(self.grammar.items())):
            for family, v in zip(grammar, values, strict=True):
                family.add_metric([name], v)
        return [queries, hits, *grammar]


@dataclass
class GatewayMetrics:
    """Every metric of one gateway (a fresh registry each, so tests can run several)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    health_probe: Callable[[], bool] = lambda: False
    """What ``/healthz`` reports: whether the gateway has a serving worker (the router sets it)."""

    def __post_init__(self) -> None:
        r = self.registry
        self.time_to_first_token = Histogram(
            "draftwise_time_to_first_token_seconds",
            "Gateway receipt of a request to its first output token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "draftwise_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request, at the gateway",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "draftwise_e2e_request_latency_seconds",
            "Gateway receipt of a request to its final event",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "draftwise_request_queue_time_seconds",
            "Time a request waited in its worker's queue before first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "draftwise_requests",
            "Finished requests by final status: stop, length, abort, or the gRPC error code",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter("draftwise_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("draftwise_generation_tokens", "Output tokens relayed", registry=r)
        self.spec_proposed = Counter(
            "draftwise_spec_decode_proposed_tokens", "Draft tokens proposed (speculative decoding)", registry=r
        )
        self.spec_accepted = Counter(
            "draftwise_spec_decode_accepted_tokens", "Draft tokens accepted by the target", registry=r
        )
        self.acceptance_rate = Histogram(
            "draftwise_spec_decode_acceptance_rate",
            "Per-request speculative acceptance rate (requests that speculated)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("draftwise_requests_in_flight", "Requests in flight at the gateway", registry=r)
        self.streams_open = Gauge("draftwise_streams_open", "Client Generate streams open", registry=r)
        self.coalesced = Counter(
            "draftwise_coalesced_deltas", "Deltas merged while a slow reader's queue was behind", registry=r
        )
        self.kv_usage = Gauge(
            "draftwise_worker_kv_cache_usage_ratio", "Share of a worker's KV blocks in use", ["worker"], registry=r
        )
        self.worker_running = Gauge(
            "draftwise_worker_requests_running", "Requests in a worker's running batch", ["worker"], registry=r
        )
        self.worker_waiting = Gauge(
            "draftwise_worker_requests_waiting", "Requests queued at a worker", ["worker"], registry=r
        )
        self.worker_tokens_per_second = Gauge(
            "draftwise_worker_tokens_per_second", "A worker's output tokens per second", ["worker"], registry=r
        )
        self.kv_cached_blocks = Gauge(
            "draftwise_kv_cached_blocks",
            "A worker's KV blocks holding prefix-cached KV a later prompt can find (in use or free)",
            ["worker"],
            registry=r,
        )
        self.worker_counters = WorkerCounters()
        r.register(self.worker_counters)
        self.routing_decisions = Counter(
            "draftwise_routing_decisions",
            "Cache-aware routing decisions by outcome: hit (the prefix's worker), new (a prefix not seen), "
            "spill (its worker over the load bound), fallback (its worker gone, unhealthy or excluded)",
            ["outcome"],
            registry=r,
        )
        self.routing_keys = Gauge(
            "draftwise_routing_keys", "Prompt prefixes the cache-aware router remembers", registry=r
        )
        self.routing_keys_dropped = Counter(
            "draftwise_routing_keys_dropped",
            "Prompt prefixes the router forgot, by reason: restart (its worker restarted), retired, evicted (table full)",
            ["reason"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "draftwise_worker_healthy", "1 when the worker answers and accepts requests", ["worker"], registry=r
        )
        self.worker_restarts = Counter(
            "draftwise_worker_restarts", "Worker processes restarted by the supervisor", ["worker"], registry=r
        )
        self.engine_errors = Counter(
            "draftwise_worker_engine_errors",
            "Requests that failed with an engine error (INTERNAL/UNAVAILABLE from a worker)",
            ["worker"],
            registry=r,
        )
        self.failovers = Counter(
            "draftwise_failovers",
            "Requests moved to another worker after tokens were sent, by reason (unavailable, stall, drain)",
            ["reason"],
            registry=r,
        )
        self.failover_recomputed_tokens = Counter(
            "draftwise_failover_recomputed_tokens",
            "Prompt and continuation tokens prefilled again because of failovers",
            registry=r,
        )
        self.resumes = Counter(
            "draftwise_resumes",
            "ResumeGeneration requests by outcome (ok, not_found, invalid_argument, resource_exhausted)",
            ["outcome"],
            registry=r,
        )
        self.detached = Gauge(
            "draftwise_requests_detached", "Requests running or kept for resumption without a client", registry=r
        )
        self.replay_bytes = Gauge(
            "draftwise_replay_buffer_bytes", "Bytes held in the replay buffers of resumable requests", registry=r
        )

    def observe_finished(self, finished: pb.Finished) -> None:
        """Usage, queue time and speculation counters of a request's Finished event."""
        usage = finished.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        if finished.timings.queue_ms > 0:
            self.queue_time.observe(finished.timings.queue_ms / 1000)
        proposed = usage.speculative_proposed_tokens
        if proposed:
            self.spec_proposed.inc(proposed)
            self.spec_accepted.inc(usage.speculative_accepted_tokens)
            self.acceptance_rate.observe(usage.speculative_accepted_tokens / proposed)

    def forget_worker(self, name: str) -> None:
        """Drop the per-worker series of a worker that left the pool."""
        gauges = (self.kv_usage, self.worker_running, self.worker_waiting, self.worker_tokens_per_second)
        for gauge in (*gauges, self.kv_cached_blocks):
            with contextlib.suppress(KeyError):
                gauge.remove(name)
        self.worker_counters.values.pop(name, None)
        self.worker_counters.grammar.pop(name, None)
        with contextlib.suppress(KeyError):
            self.worker_healthy.remove(name)

    def wsgi_app(self) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
        """The HTTP endpoint: /metrics, /healthz (and /health, its name on the OpenAI port), 404 elsewhere."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            if path in ("/healthz", "/health"):
                ok = self.health_probe()
                body = b"ok\n" if ok else b"no serving worker\n"
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [body]
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics, /healthz or /health\n"]

        return app

    def serve(self, host: str, port: int) -> WSGIServer:
        """Start the HTTP endpoint (a daemon thread); the server's ``server_port`` is the bound port."""

        class Server(ThreadingWSGIServer):
            pass

        Server.address_family, addr = _get_best_family(host, port)
        server = make_server(str(addr), port, self.wsgi_app(), Server, handler_class=_SilentHandler)
        threading.Thread(target=server.serve_forever, name="draftwise-metrics", daemon=True).start()
        return server
