"""An asyncio face on the engine: the engine loop runs in its own thread, never on the event
loop; each request is an async iterator of deltas.

    aengine = AsyncEngine(LLMEngine(config)); aengine.start()
    async for delta in aengine.generate("r1", "def f(", SamplingParams(max_tokens=16)):
        print(delta.text, end="")

Adds and aborts travel to the engine thread as commands, applied between steps, so a
caller never waits for a forward pass. Leaving the ``async for`` early aborts the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from draftwise.worker.engine import LLMEngine
from draftwise.worker.outputs import RequestDelta, StepOutput
from draftwise.worker.sampling_params import SamplingParams

log = structlog.get_logger("draftwise.async_engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestDelta | BaseException]


def _deliver(items: list[tuple[asyncio.Queue, RequestDelta]]) -> None:
    """On the event loop: hand a step's deltas to their streams."""
    for q, d in items:
        q.put_nowait(d)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepOutput], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after every step (metrics, load reports)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="draftwise-engine", daemon=True)
        self.last_stats = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the engine thread between steps."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self.is_running:
            fut.set_exception(RuntimeError("the engine loop is not running"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the deltas of one request. ValueError for a bad request, before any delta."""
        if not self.is_running:
            raise RuntimeError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            self.engine.add_request(request_id, prompt, sampling_params)
            self._streams[request_id] = stream

        await asyncio.wrap_future(self._call(add))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks are free before the next step runs."""

        def do() -> bool:
            self._streams.pop(request_id, None)
            return self.engine.abort_request(request_id)

        return await asyncio.wrap_future(self._call(do))

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                out = self.engine.step()
                self.last_stats = out.stats
                # one wake-up per event loop per step, however many streams it serves
                batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta]]] = {}
                for d in out.deltas:
                    s = self._streams.get(d.request_id)
                    if s is not None:
                        batches.setdefault(s.loop, []).append((s.queue, d))
                        if d.finished:
                            self._streams.pop(d.request_id, None)
                for loop, items in batches.items():
                    loop.call_soon_threadsafe(_deliver, items)
                if self.on_step is not None:
                    self.on_step(out)
        except BaseException as e:  # the engine died: fail every stream rather than hang it
            log.exception("engine loop failed")
            for s in self._streams.values():
                s.loop.call_soon_threadsafe(s.queue.put_nowait, RuntimeError(f"engine failed: {e!r}"))
            self._streams.clear()
            while True:
                try:
                    _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                fut.set_exception(RuntimeError(f"engine failed: {e!r}"))
            raise
