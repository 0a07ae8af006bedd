"""The engine's consistency checks (tests call them through ``LLMEngine.check_invariants`` and
``LLMEngine.check_idle_invariants``): every block owned once or free, and per-request state (text,
speculation, grammar) only for the requests still unfinished."""

from __future__ import annotations

from typing import Protocol

from draftwise.worker.core.block_manager import BlockManager
from draftwise.worker.core.scheduler import Scheduler
from draftwise.worker.sampling.grammar import Grammars
from draftwise.worker.speculative.decoder import SpecDecoder
from draftwise.worker.text.output_processor import OutputProcessor


class EngineParts(Protocol):
    """What the checks read of an engine (``LLMEngine``)."""

    scheduler: Scheduler
    blocks: BlockManager
    spec: SpecDecoder | None
    output: OutputProcessor
    grammars: Grammars


def check_running(engine: EngineParts) -> None:
    """Every block (target pool, and the draft pool with a draft model) is owned once by the request
    holding it, or free; speculation, text and grammar state only for unfinished requests."""
    reqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    engine.blocks.pool.check(r.block_table for r in reqs)
    if engine.spec is not None:
        engine.spec.check(reqs)
    ids = {r.request_id for r in reqs}
    stray = (set(engine.output.detokenizers) | set(engine.grammars.states)) - ids
    if stray:
        raise AssertionError(f"text or grammar state kept for requests that are gone: {sorted(stray)}")


def check_idle(engine: EngineParts) -> None:
    """With no request left, every block of every pool is free and no per-request state is left."""
    if engine.scheduler.num_unfinished:
        raise AssertionError(f"{engine.scheduler.num_unfinished} requests unfinished")
    blocks = engine.blocks
    blocks.pool.check([])
    if blocks.num_free_blocks != blocks.num_blocks:
        raise AssertionError(f"{blocks.num_blocks - blocks.num_free_blocks} target blocks still in use")
    if engine.spec is not None:
        engine.spec.check_idle()
    if engine.output.detokenizers or engine.grammars.states:
        left = sorted(engine.output.detokenizers), sorted(engine.grammars.states)
        raise AssertionError(f"text or grammar state left: {left}")


__all__ = ["EngineParts", "check_idle", "check_running"]
