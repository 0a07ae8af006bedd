"""The worker process: the engine behind ``draftwise.v1.WorkerService`` on grpc.aio + uvloop.

    python -m draftwise.worker.server --port 50061 [--model FOLDER] [--max-num-seqs 64 ...]

The engine loop runs on its own thread (``AsyncEngine``), so the event loop answers load and
health checks promptly at full load. When the gateway cancels a call (its client cancelled,
or its stream closed), the request is aborted and its blocks are free before the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import fields

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from draftwise.worker.async_engine import AsyncEngine
from draftwise.worker.config import EngineConfig
from draftwise.worker.engine import LLMEngine
from draftwise.worker.outputs import StepOutput
from draftwise.worker.proto_convert import events_from_delta, prompt_from_proto, sampling_params_from_proto

log = structlog.get_logger("draftwise.worker")

SERVICE_NAME = "draftwise.v1.WorkerService"


class WorkerServicer(wgrpc.WorkerServiceServicer):
    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.model_name = model_name
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tps = 0.0  # exponentially weighted output tokens per second
        aengine.on_step = self._on_step

    def _on_step(self, out: StepOutput) -> None:  # engine thread
        if out.stats is None or out.stats.step_time <= 0:
            return
        produced = sum(len(d.token_ids) for d in out.deltas)
        self._tps = 0.8 * self._tps + 0.2 * (produced / out.stats.step_time)

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
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown model {start.model!r}; this worker serves {self.model_name!r}",
            )
        try:
            params = sampling_params_from_proto(start.sampling_params)
            prompt = prompt_from_proto(start.prompt)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.in_flight += 1
        self._idle.clear()
        try:
            stream = self.aengine.generate(rid, prompt, params)
            try:
                async for delta in stream:
                    for ev in events_from_delta(delta):
                        yield wpb.WorkerServiceGenerateResponse(event=ev)
            except ValueError as e:  # the engine refused the request
                bound.info("request rejected", reason=str(e))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:  # the engine loop died
                bound.error("engine failure", error=str(e))
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                await stream.aclose()  # on cancellation: aborts the request, freeing its blocks
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def GetLoad(self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext) -> wpb.GetLoadResponse:  # noqa: N802
        sched = self.engine.scheduler
        return wpb.GetLoadResponse(
            model=self.model_name,
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting),
            num_free_kv_blocks=self.engine.blocks.num_free_blocks,
            num_total_kv_blocks=self.engine.blocks.num_blocks,
            tokens_per_second=self._tps,
            draining=self.draining,
        )

    async def Drain(self, request: wpb.DrainRequest, context: grpc.aio.ServicerContext) -> wpb.DrainResponse:  # noqa: N802
        self.draining = True
        log.info("draining", in_flight=self.in_flight)
        if request.wait:
            await self._idle.wait()
        return wpb.DrainResponse(num_requests_in_flight=self.in_flight)


async def serve(config: EngineConfig, host: str, port: int, model_name: str, ready_file: str | None = None) -> None:
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    aengine = AsyncEngine(engine)
    aengine.start()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = WorkerServicer(aengine, model_name)
    wgrpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise SystemExit(f"error: cannot listen on {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker ready", address=f"{host}:{bound_port}", model=model_name, startup_s=round(time.perf_counter() - t0, 2)
    )
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{bound_port}\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("worker stopping", in_flight=servicer.in_flight)
    servicer.draining = True
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=10.0)  # in-flight streams get up to 10 s to finish
    aengine.shutdown()


def _engine_args(p: argparse.ArgumentParser) -> None:
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.type in ("int | None", "int"):
            p.add_argument(flag, type=int, default=f.default)
        elif f.type in ("float",):
            p.add_argument(flag, type=float, default=f.default)
        else:
            p.add_argument(flag, default=f.default)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="draftwise-worker", description="a draftwise worker process (WorkerService)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (written to --ready-file)")
    p.add_argument("--model-name", default="default", help="the name clients use for this model")
    p.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    _engine_args(p)
    args = p.parse_args(argv)
    cfg = EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    try:
        run(serve(cfg, args.host, args.port, args.model_name, args.ready_file))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
