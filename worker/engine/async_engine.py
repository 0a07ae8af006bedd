"""An asyncio face on the engine: the engine loop runs in its own thread, never on the event
loop; each request is an async iterator of deltas.

    aengine = AsyncEngine(LLMEngine(config)); aengine.start()
    async for delta in aengine.generate("r1", "def f(", SamplingParams(max_tokens=16)):
        print(delta.text, end="")

Adds and aborts travel to the engine thread as commands, applied between steps, so a
caller never waits for a forward pass; text prompts are tokenized on a worker thread before
the add (a long prompt never stalls the other streams). Leaving the ``async for`` early, or
being cancelled at any moment (even while the add is still queued), aborts the request: no
request runs on without its caller and no KV block stays behind.

Failures: a request the engine failed on its own raises :class:`RequestFailedError` from its
iterator (the others go on). When the engine stops (a step-wide error, or ``shutdown``),
every stream raises :class:`EngineDeadError`, every queued or later command is answered with
it, and after a failure ``on_death`` is called once (the worker turns NOT_SERVING and exits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from draftwise.worker.core.block_manager import PrefixCacheStats
from draftwise.worker.core.outputs import RequestDelta, SpecStats, StepOutput, merge_deltas
from draftwise.worker.engine.llm_engine import EngineDeadError, LLMEngine
from draftwise.worker.sampling.grammar import GrammarStats
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.chat import ChatPrompt

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError"]

log = structlog.get_logger("draftwise.async_engine")


class RequestFailedError(RuntimeError):
    """The engine failed this request on its own (the message says why); others went on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestDelta | BaseException]
    interval: int = 1  # output tokens gathered into one delta after the first (``generate``'s stream_interval)
    held: list[RequestDelta] = field(default_factory=list)  # deltas gathered, not yet handed over
    held_tokens: int = 0
    started: bool = False  # its first delta went out

    def gather(self, d: RequestDelta) -> list[RequestDelta]:
        """On the engine thread: the deltas to hand over now (none while ``d`` is held). The first
        delta and the last go out at once; the held ones go with the next, merged, except before
        an error, which comes after them on its own (the caller raises it without its tokens)."""
        if self.interval <= 1:
            return [d]
        if self.started and not d.finished and d.error is None and self.held_tokens + len(d.token_ids) < self.interval:
            self.held.append(d)
            self.held_tokens += len(d.token_ids)
            return []
        self.started = True
        held, self.held, self.held_tokens = self.held, [], 0
        if d.error is not None:
            return [merge_deltas(held), d] if held else [d]
        return [merge_deltas([*held, d])]


def _deliver(items: list[tuple[asyncio.Queue, RequestDelta | BaseException]]) -> None:
    """On the event loop: hand a step's deltas to their streams."""
    for q, d in items:
        q.put_nowait(d)


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, RequestDelta | BaseException]]) -> None:
    with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
        loop.call_soon_threadsafe(_deliver, items)


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's load as the engine thread last published it (between steps): other threads
    read this, never the scheduler or the block pool, which the engine thread mutates."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    """The prefix cache's lifetime counters (tokens looked up, found) and its cached blocks."""
    grammar: GrammarStats = GrammarStats()
    """Structured output's lifetime counters (constrained requests, compile and mask time, masked steps)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepOutput], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after every step (metrics, load reports)
        self.on_death: Callable[[str], None] | None = None  # called once, on the engine thread, if the engine fails
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="draftwise-engine", daemon=True)
        self.dead: str | None = None  # why the loop ended; None while it runs
        self.load = self._snapshot()  # replaced (never mutated) by the engine thread

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    # ------------------------------------------------------------------ commands

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the engine thread between steps. The future always resolves: with
        EngineDeadError if the loop has ended or ends before it runs ``fn``."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.dead is not None:
            fut.set_exception(EngineDeadError(f"the engine is not running: {self.dead}"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        if self.dead is not None:  # the loop ended around the put: its last drain may have missed it
            self._fail_commands()
        return fut

    def _fail_commands(self) -> None:
        """Answer every queued command with EngineDeadError (any thread; each is taken once)."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine is not running: {self.dead}"))

    def _snapshot(self) -> LoadSnapshot:
        engine = self.engine
        sched, blocks = engine.scheduler, engine.blocks
        return LoadSnapshot(
            len(sched.running),
            len(sched.waiting),
            blocks.num_free_blocks,
            blocks.num_blocks,
            engine.prefix_cache_stats,
            engine.grammars.stats,
        )

    def _apply_commands(self) -> None:
        """Run the queued commands, then publish the load they leave."""
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                self.load = self._snapshot()
                return
            if not fut.set_running_or_notify_cancel():
                continue  # its caller gave up before it ran (e.g. a request cancelled while queued)
            try:
                result = fn()
            except Exception as e:  # handed to the caller
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def _abort_soon(self, request_id: str) -> None:
        """Abort ``request_id`` before the next step, without waiting (commands run in order,
        so this also catches an add that is still queued or running)."""

        def do() -> bool:
            self._streams.pop(request_id, None)
            return self.engine.abort_request(request_id)

        self._call(do)

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int] | ChatPrompt,
        sampling_params: SamplingParams | None = None,
        continuation: Sequence[int] = (),
        continuation_spec: SpecStats | None = None,
        cache_salt: str = "",
        stream_interval: int = 1,
    ) -> AsyncGenerator[RequestDelta, None]:
        """Stream the deltas of one request. ValueError for a bad request, before any delta;
        RequestFailedError if the engine fails it; EngineDeadError if the engine stops.
        A ChatPrompt is rendered with the model's chat template (off the engine thread too)
        and stops at the template's end-of-turn token. Requests with different ``cache_salt``
        never share cached KV blocks. ``stream_interval`` > 1: after the first delta, the
        engine thread gathers the request's deltas until they hold that many tokens (the last
        delta goes out at once), so that a caller that wants only the whole answer is woken
        a few times instead of once a token."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead or 'not started'}")
        ids: list[int] | None = None
        if isinstance(prompt, ChatPrompt):
            chat = await asyncio.to_thread(self.engine.encode_chat, prompt)
            prompt, ids = chat.text, chat.token_ids
            sampling_params = chat.sampling_params(sampling_params, self.engine.eos_token_ids)
        elif isinstance(prompt, str):  # off the engine thread: a long prompt stalls nobody
            ids = await asyncio.to_thread(self.engine.encode_prompt, prompt)
        if sampling_params is not None and sampling_params.constraint is not None:  # compiled off the engine thread
            await asyncio.to_thread(self.engine.intake.compile_constraint, sampling_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), max(1, stream_interval))

        def add() -> None:
            self.engine.add_request(
                request_id,
                prompt,
                sampling_params,
                prompt_token_ids=ids,
                continuation=continuation,
                continuation_spec=continuation_spec,
                cache_salt=cache_salt,
            )
            self._streams[request_id] = stream

        try:
            await asyncio.wrap_future(self._call(add))
        except asyncio.CancelledError:
            # cancelled while the add was queued (then it never runs) or running (then it is
            # aborted right after): nothing runs on orphaned
            self._abort_soon(request_id)
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._abort_soon(request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks are free before the next step runs."""

        def do() -> bool:
            self._streams.pop(request_id, None)
            return self.engine.abort_request(request_id)

        return await asyncio.wrap_future(self._call(do))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (inspection, tests)."""
        return await asyncio.wrap_future(self._call(lambda: fn(self.engine)))

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        reason, failed = "the engine was shut down", False
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_ranks()  # a tensor-parallel rank that died stops the engine, idle or not
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                out = self.engine.step()
                self.load = self._snapshot()
                # one wake-up per event loop per step, however many streams it serves
                batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta | BaseException]]] = {}
                for d in out.deltas:
                    s = self._streams.get(d.request_id)
                    if s is not None:
                        if d.finished:
                            self._streams.pop(d.request_id, None)
                        for ready in s.gather(d):
                            batches.setdefault(s.loop, []).append((s.queue, ready))
                for loop, items in batches.items():
                    _post(loop, items)
                if self.on_step is not None:
                    self.on_step(out)
        except BaseException as e:  # the engine died: fail every stream and command rather than hang them
            reason, failed = f"the engine failed: {e}", True
            log.error("engine loop failed", error=repr(e), exc_info=not isinstance(e, EngineDeadError))
        finally:
            self._die(reason, failed)

    def _die(self, reason: str, failed: bool) -> None:
        self.dead = reason  # from here on _call answers at once, and re-checks after its put
        err = EngineDeadError(reason)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta | BaseException]]] = {}
        for s in self._streams.values():
            batches.setdefault(s.loop, []).append((s.queue, err))
        self._streams.clear()
        for loop, items in batches.items():
            _post(loop, items)
        self._fail_commands()
        if failed and self.on_death is not None:
            try:
                self.on_death(reason)
            except Exception:
                log.exception("on_death callback failed")
