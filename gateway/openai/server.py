"""The OpenAI-compatible HTTP endpoint: aiohttp on the gateway's own event loop.

Each request goes through the same parts as a gRPC ``GenerateStream``: the same checks
(:func:`validate_start`), the same admission slots, routing, failover and metrics (a
:class:`Relay` feeding an :class:`Outbox`), and the same API keys (``Authorization: Bearer``).
A client that disconnects cancels its request: the relay cancels the worker call, which
frees the request's KV blocks. Requests over HTTP are not resumable (the client has no
handle), so the relay keeps no replay buffer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import ssl
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import prometheus_client
import structlog
from aiohttp import web

from draftwise.gateway.admit import Admitted, Refused, Why, admit
from draftwise.gateway.core import Core
from draftwise.gateway.errors import RequestError, clip
from draftwise.gateway.openai import protocol as P
from draftwise.gateway.openai import respond as R
from draftwise.gateway.openai.http_errors import HTTP_STATUS, error_code, json_errors, parse_json, raise_if_error
from draftwise.gateway.openai.legacy_generate import add_generate_route
from draftwise.gateway.openai.protocol import ApiError, ParsedRequest
from draftwise.gateway.relay import Relay
from draftwise.gateway.sampling_check import FieldError, check_sampling
from draftwise.gateway.streams import Outbox
from draftwise.gateway.tenancy import bearer_key
from draftwise.gateway.validate import validate_start
from draftwise.v1 import generation_pb2 as pb

log = structlog.get_logger("draftwise.gateway.openai")

ENDPOINTS = "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /generate (vLLM's), GET /health, GET /metrics"
OPEN_PATHS = frozenset({"/health", "/healthz", "/metrics"})
"""Paths open without an API key (load balancers, Prometheus), as on the metrics port."""
WHOLE_ANSWER_INTERVAL = 32
"""Tokens a worker gathers into one delta (after the first) for a request answered whole: one
message per token cost a non-streamed answer ~10% of its decode speed on a 2-core machine
(docs/benchmarks.md); a worker that dies then costs at most this many tokens' recomputation."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


class OpenAIServer:
    """``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (and vLLM's ``/generate``) over ``core``."""

    def __init__(self, core: Core, api_keys: frozenset[str]) -> None:
        self.core = core
        self._keys = tuple(k.encode() for k in api_keys)
        app = web.Application(middlewares=[self._errors], client_max_size=core.config.max_request_bytes)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        add_generate_route(app, self._body, self._relay)  # vLLM's legacy /generate (legacy_generate.py)
        app.router.add_get("/health", self.health)
        app.router.add_get("/healthz", self.health)
        app.router.add_get("/metrics", self.metrics)
        self.app = app
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port); the port bound. OSError when it cannot."""
        # handler_cancellation: a client that disconnects cancels its handler (and so its request)
        # shutdown_timeout: the gateway stops HTTP after its grace period, when no request is left
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        json_errors(runner)
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=False)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(
                f"cannot listen on {host}:{port} for HTTP: {e.strerror or e} (pick one with --http-port)"
            ) from None
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """API keys, and every error as OpenAI's JSON error object."""
        try:
            if self._keys and request.path not in OPEN_PATHS:
                self._check_key(request.headers.get("Authorization"))
            return await handler(request)
        except ApiError as e:
            headers = None
            if e.status == 429:
                ms = self.core.admission.retry_after_ms
                headers = {"Retry-After": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}
            if e.status >= 500:
                log.warning("http request failed", path=request.path, status=e.status, message=e.message)
            return _json(e.status, P.error_body(e.status, e.message, e.param, e.code), headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = e.reason
            if e.status == 404:
                message = f"no such endpoint: {request.method} {request.path}; this server serves {ENDPOINTS}"
            elif e.status == 405:
                message = f"{request.method} is not allowed on {request.path}; this server serves {ENDPOINTS}"
            elif e.status == 413:
                message = (
                    f"the request body is larger than {self.core.config.max_request_bytes} bytes "
                    "(--max-request-bytes): send a shorter prompt"
                )
            return _json(e.status, P.error_body(e.status, message))
        except FieldError as e:
            return _json(400, P.error_body(400, e.message, e.param))
        except Exception:  # a defect: still OpenAI's JSON error, never a bare text/plain 500
            log.exception("http request failed", path=request.path)
            return _json(500, P.error_body(500, "internal error while handling the request; the server logged it"))

    def _check_key(self, header: str | None) -> None:
        if header is None:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "malformed Authorization header: expected 'Bearer <key>'")
        given = key.strip().encode()
        ok = False
        for k in self._keys:  # compare against every key: timing says nothing about which matched
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise ApiError(401, "invalid API key", code="invalid_api_key")

    async def _body(self, request: web.Request) -> object:
        try:
            data = await request.read()
        except web.HTTPException:
            raise  # 413
        except Exception as e:  # a Content-Encoding the body does not match (not gzip, truncated, ...)
            enc = request.headers.get("Content-Encoding", "identity")
            raise ApiError(
                400, f"the request body cannot be decoded as Content-Encoding {enc[:32]!r}: {clip(str(e))}"
            ) from None
        return parse_json(data)

    # ------------------------------------------------------------------ endpoints

    async def metrics(self, request: web.Request) -> web.Response:
        """The gateway's Prometheus metrics, as on the metrics port (``--metrics-port``)."""
        body = prometheus_client.generate_latest(self.core.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.core.router.serving and not self.core.draining
        return _json(200 if ok else 503, {"status": "ok" if ok else "unavailable"})

    def _model_card(self, name: str, max_model_len: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "draftwise", "max_model_len": max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        models = self.core.router.models()
        if not models:
            raise ApiError(503, f"no worker has reported its model yet ({self.core.router.describe()}); retry shortly")
        return _json(200, {"object": "list", "data": [self._model_card(n, m) for n, m in sorted(models.items())]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        models = self.core.router.models()
        if name not in models:
            raise ApiError(404, f"the model {name[:64]!r} does not exist on this server", "model", "model_not_found")
        return _json(200, self._model_card(name, models[name]))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, P.parse_completion(await self._body(request)), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, P.parse_chat(await self._body(request)), chat=True)

    # ------------------------------------------------------------------ one request

    def _admit(self, start: pb.StartGeneration) -> Admitted:
        """The admission ticket; ApiError (503, 404, 400, 429) when the request cannot start."""
        ticket = admit(self.core, start, check=_model_for)
        if not isinstance(ticket, Refused):
            return ticket
        if ticket.why == Why.DRAINING:
            raise ApiError(503, "the server is shutting down; send it elsewhere")
        if ticket.why == Why.AT_CAPACITY:
            adm = self.core.admission
            raise ApiError(
                429,
                f"the server is at capacity ({adm.max_in_flight} requests in flight); "
                f"retry after {adm.retry_after_ms} ms (Retry-After header)",
                code="rate_limit_exceeded",
            )
        status = HTTP_STATUS.get(ticket.code, 500)
        raise ApiError(status, ticket.message, "model" if status == 404 else None, error_code(status))

    def _relay(
        self, request: web.Request, rid: str, start: pb.StartGeneration, whole: bool = False
    ) -> tuple[Relay, Outbox, str]:
        """A started relay of ``start`` (admitted: ApiError when it cannot be), its outbox, its model.
        Its cache salt follows the caller's API key (gateway/tenancy.py). ``whole``: the caller
        reads only the whole answer (not streamed), so the worker sends its tokens in deltas of
        WHOLE_ANSWER_INTERVAL (the first token at once: time to first token stays measured)."""
        ticket = self._admit(start)
        cap = self.core.config.max_buffered_tokens
        outbox = Outbox(cap)
        salt = self.core.salts.for_key(bearer_key(request.headers.get("Authorization")))
        streamed = self.core.config.stream_interval
        interval = max(min(WHOLE_ANSWER_INTERVAL, cap), streamed) if whole else streamed
        relay = Relay(self.core, rid, start, ticket, outbox, None, salt, interval)
        relay.buffer = None  # not resumable over HTTP: a client that leaves cancels its request
        relay.start()
        return relay, outbox, ticket.model

    async def _generate(self, request: web.Request, parsed: ParsedRequest, chat: bool) -> web.StreamResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if len(parsed.starts) > 1:
            return await self._batch(request, parsed, rid)
        relay, outbox, model = self._relay(request, rid, parsed.start, whole=not parsed.stream)
        try:
            first = await outbox.get()
            try:
                raise_if_error(first)
            except ApiError as e:  # refused before it started: a worker's refusal of the constraint names its field
                raise R.name_constraint(e, parsed) from None
            if parsed.stream:
                return await R.stream(request, parsed, chat, rid, model, outbox, first)
            choice, usage, spec = await R.collect(rid, parsed, chat, outbox, first)
            return _json(200, R.response(rid, chat, model, [choice], usage, spec))
        finally:
            relay.cancel()  # no-op once finished; else (the client left) the worker frees its KV blocks

    async def _batch(self, request: web.Request, parsed: ParsedRequest, rid: str) -> web.StreamResponse:
        """A list of prompts (``/v1/completions``): one request each, run together, one choice each
        (``index`` i for prompt i), their usage summed; streamed, their chunks interleave. Any error
        fails the whole batch (streamed: an error event, then ``[DONE]``)."""
        relays: list[Relay] = []
        model = ""
        try:
            outboxes = []
            for i, start in enumerate(parsed.starts):
                relay, outbox, model = self._relay(request, f"{rid}-{i}", start, whole=not parsed.stream)
                relays.append(relay)
                outboxes.append(outbox)
            if parsed.stream:
                return await R.stream_batch(request, parsed, rid, model, outboxes)
            try:
                results = await asyncio.gather(
                    *(R.collect(f"{rid}-{i}", parsed, False, ob, None) for i, ob in enumerate(outboxes))
                )
            except ApiError as e:
                raise R.name_constraint(e, parsed) from None
        finally:
            for relay in relays:
                relay.cancel()
        choices = [dict(choice, index=i) for i, (choice, _, _) in enumerate(results)]
        total = pb.Usage()
        for _, u, _ in results:
            P.add_usage(total, u)
        return _json(200, R.response(rid, False, model, choices, total, None))


def _model_for(core: Core, start: pb.StartGeneration) -> str:
    """The model to run ``start`` on, OpenAI's way: a model this server does not serve is
    NOT_FOUND (404 ``model_not_found``); then the gateway's own checks. Sampling parameters
    first: a bad one is 400 even while no worker is up."""
    check_sampling(start.sampling_params)
    models = core.router.models()
    if not models:
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"no worker has reported its model yet ({core.router.describe()}); retry shortly",
        )
    wanted = start.model or core.default_model()
    if wanted is not None and wanted not in models:
        served = ", ".join(sorted(models))
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"the model {wanted[:64]!r} does not exist on this server; it serves: {served} (GET /v1/models)",
        )
    return validate_start(core, start)


async def start_openai_server(
    core: Core, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None
) -> OpenAIServer:
    """An OpenAIServer listening on host:port (HTTPS with the gateway's certificate when it has one)."""
    ctx = None
    if tls_cert and tls_key:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        await asyncio.to_thread(ctx.load_cert_chain, tls_cert, tls_key)
    server = OpenAIServer(core, core.config.api_keys)
    await server.start(host, port, ctx)
    return server
