"""The asyncio face of the engine under faults: a request cancelled at any moment (even while
its add is still queued) leaves nothing behind and never kills the engine thread; after the
engine dies every stream and every command is answered, none waits forever; text prompts
are sized and tokenized off the engine thread (issue 10, defects 2, 3 and 6)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from draftwise.worker import SamplingParams
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.async_engine import AsyncEngine, EngineDeadError
from draftwise.worker.engine.llm_engine import LLMEngine

CONFIG = EngineConfig(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=16)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(CONFIG)


@pytest.fixture
def aengine(engine):
    a = AsyncEngine(engine)
    a.start()
    yield a
    a.shutdown()


async def _collect(aengine: AsyncEngine, rid: str, prompt: str, params: SamplingParams) -> list[int]:
    toks: list[int] = []
    async for d in aengine.generate(rid, prompt, params):
        assert d.first_token_index == len(toks)
        toks.extend(d.token_ids)
    return toks


async def _idle(aengine: AsyncEngine) -> None:
    """The engine holds no request and no block (checked on its own thread)."""
    for _ in range(100):
        n = await aengine.call(lambda e: e.scheduler.num_unfinished + len(e.requests))
        if n == 0:
            break
        await asyncio.sleep(0.01)
    await aengine.call(lambda e: e.check_idle_invariants())


def test_cancel_while_the_add_is_queued(aengine):
    """Defect 2: the caller's future was cancelled while its add waited; the engine thread's
    set_result then raised InvalidStateError and the loop died."""

    async def main():
        gate, holding = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            gate.wait(10)

        blocker = aengine._call(hold)  # holds the engine thread between steps
        await asyncio.to_thread(holding.wait, 10)
        task = asyncio.create_task(_collect(aengine, "queued", "def f(x):", LONG))
        for _ in range(1000):  # until the add is queued behind the blocker
            if aengine._commands.qsize() >= 1:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the add was never queued")
        task.cancel()
        gate.set()
        await asyncio.wrap_future(blocker)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert aengine.is_running
        await _idle(aengine)
        added = await aengine.call(lambda e: "queued" in e.requests)
        assert not added  # the cancelled add never ran: no orphan
        assert len(await _collect(aengine, "after", "def g(x):", SHORT)) == 4

    asyncio.run(main())


def test_cancel_right_after_the_add_ran_aborts_the_request(aengine):
    """The add ran but its caller was cancelled before hearing back: the request is aborted
    rather than left running with nobody to read it."""

    async def main():
        first, second, holding = threading.Event(), threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            first.wait(10)

        blocker = aengine._call(hold)  # holds the engine thread between steps
        await asyncio.to_thread(holding.wait, 10)
        task = asyncio.create_task(_collect(aengine, "ran", "def f(x):", LONG))
        for _ in range(1000):  # until the add is queued behind the blocker
            if aengine._commands.qsize() >= 1:
                break
            await asyncio.sleep(0.005)
        holder = aengine._call(lambda: second.wait(10))  # right behind the add: no step between them
        first.set()
        for _ in range(1000):
            if await asyncio.to_thread(lambda: "ran" in aengine.engine.requests):
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the add never ran")
        task.cancel()  # the add ran; its caller goes away before (or just as) it hears back
        second.set()
        await asyncio.wrap_future(blocker)
        await asyncio.wrap_future(holder)
        with pytest.raises(asyncio.CancelledError):
            await task
        await _idle(aengine)

    asyncio.run(main())


def test_cancel_at_random_moments(aengine):
    """Requests cancelled at random times (before the add, while queued, mid-prefill, while
    decoding, after finishing) next to requests that run to the end."""

    async def main():
        rng = random.Random(10)
        keep = [asyncio.create_task(_collect(aengine, f"keep{i}", f"def k{i}(x):", LONG)) for i in range(3)]
        victims = []
        for i in range(60):
            params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 30), seed=i)
            t = asyncio.create_task(_collect(aengine, f"v{i}", f"# {i}\n" * rng.randint(1, 40), params))
            victims.append(t)
            await asyncio.sleep(rng.uniform(0, 0.004))
            if rng.random() < 0.8:
                asyncio.get_running_loop().call_later(rng.uniform(0, 0.05), t.cancel)
        results = await asyncio.gather(*victims, return_exceptions=True)
        assert all(isinstance(r, list | asyncio.CancelledError) for r in results), results
        assert any(isinstance(r, asyncio.CancelledError) for r in results)
        for t in keep:
            assert len(await t) == LONG.max_tokens
        assert aengine.is_running
        await _idle(aengine)

    asyncio.run(main())


def test_a_request_failed_while_its_deltas_are_gathered_gets_its_tokens_then_the_error(aengine):
    """``stream_interval``: the tokens held when the engine fails the request come out before the
    RequestFailedError (not merged into the error delta, whose tokens the caller never sees); its
    blocks are freed and the engine goes on."""
    from draftwise.worker.engine.async_engine import RequestFailedError

    async def main():
        ref = await _collect(aengine, "ref", "def f(x):", LONG)
        got: list[int] = []
        calls, taken = [0], [0]  # patched calls; tokens the detokenizer took in before the failure

        def break_after_three(e: LLMEngine) -> None:
            det = e.output.detokenizers["gathered"]
            add = det.add_tokens
            taken[0] = len(det.output_token_ids)  # the engine may have stepped on since the first delta

            def add_tokens(tokens):
                calls[0] += 1
                if calls[0] > 3:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                taken[0] += len(tokens)
                return add(tokens)

            det.add_tokens = add_tokens

        with pytest.raises(RequestFailedError, match="injected"):
            async for d in aengine.generate("gathered", "def f(x):", LONG, stream_interval=8):
                assert d.first_token_index == len(got) and d.error is None
                got.extend(d.token_ids)
                if len(got) == 1:  # the first delta comes at once; then the next steps' tokens are held
                    await aengine.call(break_after_three)
        # every token taken in before the failure reaches the caller, the held ones included
        assert calls[0] == 4 and taken[0] >= 4 and got == ref[: taken[0]], (calls, taken, got)
        await _idle(aengine)
        assert await _collect(aengine, "after", "def f(x):", LONG) == ref

    asyncio.run(main())


def test_commands_posted_as_the_engine_dies_are_answered():
    """Defect 3: a command posted after the liveness check but after the dying loop's last
    drain was never answered, and its caller hung."""
    engine = LLMEngine(CONFIG)
    aengine = AsyncEngine(engine)
    aengine.start()

    class LateQueue:
        """The race, made certain: a put that lands only after the loop has died and drained."""

        def __init__(self, inner):
            self.inner = inner

        def put(self, item):
            aengine._thread.join(10)
            self.inner.put(item)

        def get_nowait(self):
            return self.inner.get_nowait()

    def oom(_chunks):
        raise torch.OutOfMemoryError("injected: out of memory")

    aengine._commands = LateQueue(aengine._commands)
    posted: list = []
    poster = threading.Thread(target=lambda: posted.append(aengine._call(lambda: 1)))
    poster.start()  # checks liveness now (alive), then its put waits for the loop to die

    async def main():
        await asyncio.sleep(0.05)
        engine.runner.run = oom
        engine.add_request("a", "def f(x):", LONG)  # the next step dies (no stream: nobody else waits)
        aengine._wake.set()
        await asyncio.to_thread(poster.join, 10)
        assert posted, "the poster never returned"
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(asyncio.wrap_future(posted[0]), 10)

    asyncio.run(main())
    assert not aengine.is_running and "out of memory" in aengine.dead


def test_engine_death_fails_every_stream_and_every_later_call():
    engine = LLMEngine(CONFIG)
    aengine = AsyncEngine(engine)
    deaths: list[str] = []
    aengine.on_death = deaths.append
    aengine.start()

    async def main():
        tasks = [asyncio.create_task(_collect(aengine, f"r{i}", f"def f{i}(x):", LONG)) for i in range(4)]
        while await aengine.call(lambda e: e.num_steps) < 3:
            await asyncio.sleep(0.01)

        def oom(_chunks):
            raise torch.OutOfMemoryError("injected: out of memory")

        engine.runner.run = oom
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            async for _ in aengine.generate("late", "def g(x):", SHORT):
                pass
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(aengine.abort("r0"), 5)

    asyncio.run(main())
    aengine.shutdown()  # the engine thread calls on_death after failing the streams: wait for it (CI saw the race)
    assert len(deaths) == 1 and "out of memory" in deaths[0]


def test_a_huge_text_prompt_is_refused_by_its_size_without_tokenizing(aengine):
    """Defect 6: a 3.9 MB prompt was tokenized on the engine thread (stalling every stream for
    23 s) before being refused; now its byte length alone refuses it."""
    engine = aengine.engine
    calls: list[str] = []
    encode = engine.tokenizer.encode

    def counting_encode(text: str) -> list[int]:
        calls.append(threading.current_thread().name)
        return encode(text)

    engine.tokenizer.encode = counting_encode
    try:

        async def main():
            with pytest.raises(ValueError, match="bytes"):
                async for _ in aengine.generate("huge", "x = 1\n" * 650_000, SHORT):
                    pass
            assert calls == []  # refused before tokenizing
            toks = await _collect(aengine, "normal", "def f(x):", SHORT)
            assert len(toks) == 4
            assert calls and all(name != "draftwise-engine" for name in calls)  # tokenized off the engine thread
            # a prompt under the byte bound but over max_model_len tokens: refused after tokenizing
            with pytest.raises(ValueError, match="max_model_len"):
                async for _ in aengine.generate("long", "a b c d e f g h " * 200, SHORT):
                    pass
            await _idle(aengine)

        asyncio.run(main())
    finally:
        del engine.tokenizer.encode


class _ThreadCheckedList(list):
    """A list that records which threads asked its length."""

    def __init__(self, items, readers: set[str]) -> None:
        super().__init__(items)
        self.readers = readers

    def __len__(self) -> int:
        self.readers.add(threading.current_thread().name)
        return super().__len__()


def test_get_load_reads_the_snapshot_the_engine_thread_publishes(engine):
    """GetLoad runs on the event loop while the engine thread mutates the scheduler: it reads
    the LoadSnapshot published between steps, never the scheduler's lists themselves."""
    from draftwise.worker.serving.server import WorkerServicer

    class Context:  # GetLoad only sets trailing metadata on its context
        def set_trailing_metadata(self, md) -> None:
            self.md = md

    readers: set[str] = set()
    sched = engine.scheduler
    sched.running = _ThreadCheckedList(sched.running, readers)
    a = AsyncEngine(engine)
    servicer = WorkerServicer(a, "m")
    readers.clear()  # the first snapshot is taken here, before the engine thread runs
    a.start()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    async def main() -> list:
        loads = []
        stream = a.generate("snap", "def f(x):", params)
        async for _ in stream:
            loads.append(await servicer.GetLoad(None, Context()))  # type: ignore[arg-type]
        await _idle(a)
        loads.append(await servicer.GetLoad(None, Context()))  # type: ignore[arg-type]
        return loads

    try:
        loads = asyncio.run(main())
        seen = set(readers)
    finally:
        a.shutdown()
        sched.running = list.copy(sched.running)
    assert seen == {"draftwise-engine"}, seen  # the event loop never read the live list
    assert any(lo.num_requests_running == 1 for lo in loads[:-1])
    last = loads[-1]
    assert last.num_requests_running == last.num_requests_waiting == 0
    assert last.num_free_kv_blocks == last.num_total_kv_blocks == engine.blocks.num_blocks
