"""The worker process: the engine behind ``draftwise.v1.WorkerService`` on grpc.aio + uvloop.

    python -m draftwise.worker.serving.server --port 50061 --internal-secret-file SECRET [--model FOLDER] ...

Every call but grpc.health.v1 must carry the launch's shared secret (``draftwise.hop``;
``draftwise serve`` makes one per launch): only the gateway reaches the engine. The engine loop runs on its own thread (``AsyncEngine``), so the event loop answers load and
health checks promptly at full load. When the gateway cancels a call (its client cancelled,
or its stream closed), the request is aborted and its blocks are free before the next step.
``GetLoad`` also sends the model's context length as trailing metadata
(``draftwise-max-model-len``), which the gateway reports in ListModels. With
``--parent-pid`` the worker exits when that process is gone (``draftwise serve`` passes its
own pid, so workers never outlive it). A request the engine fails on its own ends with
INTERNAL (the others go on); if the engine stops (out of memory, a device error), health
turns NOT_SERVING at once, in-flight calls end with UNAVAILABLE and the process exits with
status 1, for its supervisor to replace.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from draftwise.envflags import apply_env, port_number
from draftwise.flagtable import add_flags, config_values, table
from draftwise.hop import InternalSecretInterceptor, read_secret_file
from draftwise.logs import configure_logging, wrap_native_stderr
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from draftwise.wire import DRAFT_MODEL_KEY, MAX_MODEL_LEN_KEY, SPEC_METHOD_KEY, SPEC_TOKENS_KEY
from draftwise.worker.core.config import EngineConfig, as_flags
from draftwise.worker.core.outputs import StepOutput
from draftwise.worker.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.serving.proto_convert import (
    continuation_from_proto,
    finished_metadata,
    prompt_from_proto,
    responses_from_delta,
    sampling_params_from_proto,
)

log = structlog.get_logger("draftwise.worker")

MAX_MESSAGE_BYTES = 64 << 20
"""The worker's message limits: at least the gateway's transport limit, so the internal hop
never refuses a request the gateway admitted (the gateway checks the request size)."""
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

SERVICE_NAME = "draftwise.v1.WorkerService"
"""Trailing metadata of GetLoad: the served model's context length."""
TOKENS_PER_SECOND_WINDOW_S = 5.0
"""GetLoad's tokens_per_second counts the output tokens of this many last seconds."""


class WorkerServicer(wgrpc.WorkerServiceServicer):
    def __init__(self, aengine: AsyncEngine, model_name: str, started_at: float | None = None) -> None:
        self.aengine = aengine
        self.started_at = time.time() if started_at is None else started_at
        """When this worker process started (unix seconds): GetLoad's worker_started_at."""
        self.engine = aengine.engine
        self.model_name = model_name
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._produced: collections.deque[tuple[float, int]] = collections.deque()  # (time, output tokens) per step
        self._produced_lock = threading.Lock()
        aengine.on_step = self._on_step

    @property
    def _model_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the gateway's ListModels reports about this worker's model, sent with GetLoad."""
        eng = self.engine
        md: list[tuple[str, str]] = [(MAX_MODEL_LEN_KEY, str(eng.max_model_len))]
        cfg = eng.config
        if eng.spec_method is not None and eng.spec is not None:
            method = eng.spec_method.split("+")[0]  # a hybrid ("draft+suffix") is reported by its model drafter
            md.append((SPEC_METHOD_KEY, method))
            md.append((SPEC_TOKENS_KEY, str(cfg.spec_k)))
            if method not in ("ngram", "suffix"):  # a named drafter: a draft model, an EAGLE or Medusa head
                head = getattr(eng.spec.proposer.parts[0], "head", None)  # the loaded head, if any
                folder = getattr(head, "folder", None)
                md.append((DRAFT_MODEL_KEY, draft_model_name(cfg.speculative_model, method, folder)))
        return tuple(md)

    def _on_step(self, out: StepOutput) -> None:  # engine thread
        produced = sum(len(d.token_ids) for d in out.deltas)
        if produced:
            with self._produced_lock:
                self._produced.append((time.monotonic(), produced))

    def tokens_per_second(self) -> float:
        """Output tokens per second over the last TOKENS_PER_SECOND_WINDOW_S seconds."""
        since = time.monotonic() - TOKENS_PER_SECOND_WINDOW_S
        with self._produced_lock:
            while self._produced and self._produced[0][0] < since:
                self._produced.popleft()
            total = sum(n for _, n in self._produced)
        return total / TOKENS_PER_SECOND_WINDOW_S

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: wpb.WorkerServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.WorkerServiceGenerateResponse]:
        start = request.start
        rid = start.request_id
        bound = log.bind(request_id=rid)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining; retry on another worker")
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if start.model and start.model != self.model_name:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {start.model!r}; this worker serves {self.model_name!r}",
            )
        try:
            params = sampling_params_from_proto(start.sampling_params, start.speculation)
            prompt = prompt_from_proto(start.prompt)
            continuation, continuation_spec = continuation_from_proto(start)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.in_flight += 1
        self._idle.clear()
        try:
            stream = self.aengine.generate(
                rid, prompt, params, continuation, continuation_spec, request.cache_salt, request.stream_interval
            )
            try:
                async for delta in stream:
                    for resp in responses_from_delta(delta):
                        yield resp
            except ValueError as e:  # the engine refused the request
                bound.info("request rejected", reason=str(e))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), finished_metadata(e))
            except RequestFailedError as e:  # the engine failed this request alone; the others go on
                bound.error("request failed", error=str(e))
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            except EngineDeadError as e:  # the engine stopped: this worker is going away
                bound.error("engine failure", error=str(e))
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"the worker's engine stopped ({e}); retry on another worker"
                )
            finally:
                await stream.aclose()  # on cancellation: aborts the request, freeing its blocks
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def GetLoad(self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext) -> wpb.GetLoadResponse:  # noqa: N802
        load = self.aengine.load  # published by the engine thread between steps
        context.set_trailing_metadata(self._model_metadata)
        return wpb.GetLoadResponse(
            model=self.model_name,
            num_requests_running=load.num_running,
            num_requests_waiting=load.num_waiting,
            num_free_kv_blocks=load.num_free_blocks,
            num_total_kv_blocks=load.num_total_blocks,
            tokens_per_second=self.tokens_per_second(),
            draining=self.draining,
            prefix_cache_queries=load.prefix_cache.queries,
            prefix_cache_hits=load.prefix_cache.hits,
            num_cached_kv_blocks=load.prefix_cache.cached_blocks,
            worker_started_at=self.started_at,
            constrained_requests=load.grammar.requests,
            grammar_compile_seconds=load.grammar.compile_seconds,
            grammar_mask_seconds=load.grammar.mask_seconds,
            grammar_masked_steps=load.grammar.masked_steps,
        )

    async def Drain(self, request: wpb.DrainRequest, context: grpc.aio.ServicerContext) -> wpb.DrainResponse:  # noqa: N802
        if request.resume:  # undo an earlier Drain
            self.draining = False
            log.info("resumed", in_flight=self.in_flight)
            return wpb.DrainResponse(num_requests_in_flight=self.in_flight)
        self.draining = True
        log.info("draining", in_flight=self.in_flight)
        if request.wait:
            await self._idle.wait()
        return wpb.DrainResponse(num_requests_in_flight=self.in_flight)


def default_model_name(model: str | Path | None) -> str:
    """The name clients use: "draftwise-target" for the embedded default, else the folder's name."""
    return "draftwise-target" if model is None else Path(model).resolve().name


def draft_model_name(model: str | Path | None, method: str = "draft", head_folder: str | Path | None = None) -> str:
    """The drafter's name that ListModels reports (``ModelInfo.draft_model``).

    A draft model (``method`` "draft"): "draftwise-draft" for the embedded default, else the
    checkpoint folder's name. An EAGLE or Medusa head: the name of ``head_folder``, the folder
    the engine loaded (for ``model`` None or "default", the head shipped for the target), else
    of the folder ``model`` names; "shipped" when no folder is known (the shipped head, unnamed).
    """
    given = None if model is None or str(model) == "default" else model
    if method in ("eagle", "medusa"):
        folder = head_folder if head_folder is not None else given
        return "shipped" if folder is None else Path(folder).resolve().name
    return "draftwise-draft" if given is None else Path(given).resolve().name


async def _watch(aengine: AsyncEngine, parent_pid: int | None, stop: asyncio.Event) -> str:
    """Wait until the engine loop dies or the parent process is gone; say which."""
    while not stop.is_set():
        if not aengine.is_running:
            return "engine"
        if parent_pid is not None and os.getppid() != parent_pid:
            return "parent"
        await asyncio.sleep(0.25)
    return "signal"


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    model_name: str,
    ready_file: str | None = None,
    parent_pid: int | None = None,
    grace_s: float = 10.0,
    internal_secret: str | None = None,
) -> int:
    t0, started_at = time.perf_counter(), time.time()
    engine = LLMEngine(config)
    aengine = AsyncEngine(engine)
    aengine.start()
    # every call but health must carry the launch's secret (None: --insecure-internal)
    interceptors = [InternalSecretInterceptor(internal_secret)] if internal_secret is not None else []
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    servicer = WorkerServicer(aengine, model_name, started_at)
    wgrpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]  (a lazily imported submodule)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def not_serving() -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_death(reason: str) -> None:  # engine thread: health says so at once, then the process exits
        servicer.draining = True
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            loop.call_soon_threadsafe(lambda: (loop.create_task(not_serving()), stop.set()))

    aengine.on_death = on_death
    try:
        bound_port = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's "Failed to bind"
        bound_port = 0
    if bound_port == 0:
        aengine.shutdown()
        raise OSError(f"cannot listen on {host}:{port} (in use?)")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker ready",
        address=f"{host}:{bound_port}",
        model=model_name,
        max_model_len=engine.max_model_len,
        startup_s=round(time.perf_counter() - t0, 2),
    )
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{bound_port}\n")
        os.replace(tmp, ready_file)  # readers never see a partial file

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    why = await _watch(aengine, parent_pid, stop)
    if not aengine.is_running:
        why = "engine"
    log.info("worker stopping", reason=why, in_flight=servicer.in_flight)
    servicer.draining = True
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # in-flight streams get grace_s to finish (nobody reads them once the parent is gone)
    await server.stop(grace=1.0 if why == "parent" else grace_s)
    aengine.shutdown()
    return 1 if why == "engine" else 0


def build_parser(prog: str = "python -m draftwise.worker.serving.server") -> argparse.ArgumentParser:
    """The worker's flags (``draftwise worker``), each also read from ``DRAFTWISE_<FLAG>``."""
    p = argparse.ArgumentParser(prog=prog, description="a draftwise worker process (WorkerService)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument(
        "--port", type=port_number, default=0, help="port to listen on (default 0: any free one, see --ready-file)"
    )
    p.add_argument(
        "--model-name", default=None, help="the name clients use (default: draftwise-target, or the folder's name)"
    )
    p.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the parent) is gone")
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument(
        "--internal-secret-file",
        default=None,
        help="file holding the shared secret every call must carry (metadata draftwise-internal-secret); "
        "draftwise serve makes one per launch",
    )
    p.add_argument(
        "--insecure-internal",
        action="store_true",
        help="serve without --internal-secret-file: any local process may then call Generate, GetLoad and Drain",
    )
    p.add_argument(
        "--log-format", choices=["auto", "json", "console"], default="auto", help="log lines (default: auto)"
    )
    p.add_argument("--log-level", default="info", help="debug | info | warning | error (default info)")
    add_flags(p, table(EngineConfig))
    return apply_env(p)


def main(argv: list[str] | None = None, prog: str = "python -m draftwise.worker.serving.server") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        configure_logging(args.log_format, args.log_level)
        wrap_native_stderr(process="worker")  # gRPC core's lines as JSON too, under JSON logs
        cfg = EngineConfig(**config_values(args, table(EngineConfig)))
    except ValueError as e:
        print(f"error: {as_flags(str(e))}", file=sys.stderr)
        return 2
    if args.internal_secret_file is None and not args.insecure_internal:
        print(
            "error: a worker needs --internal-secret-file FILE (the same file as its gateway's): without it any "
            "local process could call it directly, bypassing API keys and admission; --insecure-internal serves "
            "without authentication anyway",
            file=sys.stderr,
        )
        return 2
    try:
        secret = None if args.internal_secret_file is None else read_secret_file(args.internal_secret_file)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.model_name or default_model_name(cfg.model)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    try:
        return run(
            serve(cfg, args.host, args.port, name, args.ready_file, args.parent_pid, args.shutdown_grace, secret)
        )
    except (ValueError, OSError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
