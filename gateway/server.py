"""The gateway server: grpc.aio (on uvloop when run as a program) serving GenerateService,
gRPC health checking and server reflection, with optional API keys and TLS, and Prometheus
metrics on their own HTTP port.

    python -m draftwise.gateway --port 50051 --worker 127.0.0.1:50061 --worker 127.0.0.1:50062
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from draftwise.gateway.admission import Admission
from draftwise.gateway.auth import ApiKeyInterceptor
from draftwise.gateway.config import MAX_RECEIVE_BYTES, GatewayConfig
from draftwise.gateway.core import Core
from draftwise.gateway.decode import DecodeInterceptor
from draftwise.gateway.failover import watch
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.openai import OpenAIServer, start_openai_server
from draftwise.gateway.reflection import enable_reflection
from draftwise.gateway.router import Router
from draftwise.gateway.service import SERVICE_NAME, GenerateServicer, add_generate_service

log = structlog.get_logger("draftwise.gateway")

SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),  # the gateway checks max_request_bytes itself
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # calls that arrived while the event loop was busy wait for it rather than being dropped by
    # gRPC with a bare CANCELLED (its default past 1,000 waiting): each then gets a real answer,
    # RESOURCE_EXHAUSTED with the retry hint when over capacity
    ("grpc.server.max_pending_requests", 1 << 20),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
)


class Gateway:
    """One gateway: ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.health = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]  (a lazily imported submodule)
        self.router = Router(
            config.workers,
            self.metrics,
            poll_interval_s=config.load_poll_interval_s,
            timeout_s=config.load_timeout_s,
            on_health_change=self._on_health_change,
            names=config.worker_names,
            internal_secret=config.internal_secret,
            routing=config.routing,
            prefix_max_keys=config.prefix_routing_max_keys,
        )
        self.core = Core(
            config=config,
            router=self.router,
            admission=Admission(config.max_in_flight, config.retry_after_ms),
            metrics=self.metrics,
            id_prefix=f"gw{uuid.uuid4().hex[:8]}",
        )
        core = self.core
        self.router.watchers.append(lambda: watch(core))  # failover after each round of load polls
        interceptors: list[grpc.aio.ServerInterceptor] = [DecodeInterceptor(self.metrics)]
        if config.api_keys:
            interceptors.append(ApiKeyInterceptor(config.api_keys))
        self.server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_server = None
        self.http: OpenAIServer | None = None
        self.http_port: int | None = None
        self._serving = asyncio.Event()
        self._health_tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        cfg = self.config
        add_generate_service(GenerateServicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert and cfg.tls_key:
                pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
                self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {address}: the port is in use (or the address is not local)")
        if cfg.http_port is not None:  # before anything runs: a taken port is an error, nothing to undo
            self.http = await start_openai_server(self.core, cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)
            self.http_port = self.http.port
        await self._set_health(False)
        await self.router.start()
        await self.server.start()
        if cfg.metrics_port is not None:
            self._metrics_server = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
            self.metrics_port = self._metrics_server.server_port
        log.info(
            "gateway listening",
            address=f"{cfg.host}:{self.port}",
            tls=bool(cfg.tls_cert),
            auth=bool(cfg.api_keys),
            workers=list(cfg.workers),
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            serving=self.router.serving,
        )

    def _on_health_change(self, serving: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._set_health(serving))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, serving: bool) -> None:
        serving = serving and not self.core.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        if serving:
            self._serving.set()
        else:
            self._serving.clear()
        log.info("health", status="SERVING" if serving else "NOT_SERVING")

    async def wait_serving(self, timeout: float) -> bool:
        """Whether some worker became healthy within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._serving.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for ``grace`` seconds (default: the
        config's), end the rest with UNAVAILABLE, then close."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        core = self.core
        core.draining = True
        self.metrics.health_probe = lambda: False  # /healthz: 503 from the first moment of the shutdown
        await self._set_health(False)
        log.info("gateway stopping", in_flight=len(core.relays), streams=len(core.streams), grace_s=grace)
        for stream in list(core.streams):
            stream.shutdown()
        deadline = time.monotonic() + grace
        while core.relays and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for relay in list(core.relays):
            relay.cancel(grpc.StatusCode.UNAVAILABLE, "the server shut down before the request finished; retry it")
        # give the final events a moment to reach their clients, then end every call
        await self.server.stop(1.0 if core.relays or core.streams else 0.2)
        if self.http is not None:
            await self.http.stop()
        await self.router.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        log.info("gateway stopped")


def write_ready_file(path: str | os.PathLike[str], port: int) -> None:
    """Write ``port`` to ``path`` atomically (readers never see a partial file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)
