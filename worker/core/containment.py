"""Per-request containment: an error that belongs to one request ends that request, never the
step (docs/engine.md, "Failures"). Every isolation site of the step goes through
:func:`contain`: run the whole batch; when that fails with an error that is not step-wide, run
each item alone, keep what succeeds and report each item that still fails as a
:class:`Failure`. The engine finishes failed requests in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import structlog
import torch

if TYPE_CHECKING:
    from draftwise.worker.core.request import Request

log = structlog.get_logger("draftwise.engine")

T = TypeVar("T")
R = TypeVar("R")

_FATAL_MARKERS = (
    "out of memory",
    "cuda error",
    "cublas",
    "cudnn",
    "device-side assert",
    "illegal memory access",
    "nccl",
    "hip error",
    "tensor-parallel",  # a step the ranks no longer run together (worker/model/model_runner.py)
)


class EngineDeadError(RuntimeError):
    """The engine hit an error that poisons the whole step (device error, out of memory, a
    broken invariant) and stopped: every request on it is lost; the process should exit so
    that a supervisor replaces it."""


def is_step_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` poisons the whole step rather than one request's rows: out of memory
    and device errors (after which the device state cannot be trusted)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError | EngineDeadError):
        return True
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _FATAL_MARKERS)


@dataclass(frozen=True)
class Failure:
    """A request that failed on its own this step, and why."""

    request: Request
    error: BaseException


def contain(
    items: Sequence[T],
    run: Callable[[Sequence[T]], list[R]],
    request_of: Callable[[T], Request],
    what: str,
    reset: Callable[[T], None] | None = None,
) -> tuple[list[tuple[T, R]], list[Failure]]:
    """``run(items)`` (one result per item, in order), contained: when the batch fails, each
    item runs alone (:func:`isolate`). A step-wide error is raised, never contained."""
    if not items:
        return [], []
    try:
        return list(zip(items, run(items), strict=True)), []
    except Exception as e:
        if is_step_fatal(e):
            raise
        log.warning(f"{what} failed for the batch; isolating", error=repr(e), items=len(items))
    return isolate(items, run, request_of, reset)


def isolate(
    items: Sequence[T],
    run: Callable[[Sequence[T]], list[R]],
    request_of: Callable[[T], Request],
    reset: Callable[[T], None] | None = None,
) -> tuple[list[tuple[T, R]], list[Failure]]:
    """After a batch failed: ``run([item])`` for each item alone (after ``reset(item)``:
    whatever the failed batch left behind goes); those that still fail come back as failures."""
    done: list[tuple[T, R]] = []
    failed: list[Failure] = []
    for item in items:
        if reset is not None:
            reset(item)
        try:
            done.append((item, run([item])[0]))
        except Exception as e:
            if is_step_fatal(e):
                raise
            failed.append(Failure(request_of(item), e))
    return done, failed


def contain_each(
    items: Sequence[T], run: Callable[[T], R], request_of: Callable[[T], Request]
) -> tuple[list[tuple[T, R]], list[Failure]]:
    """``run(item)`` for each item on its own (work that is per request already), contained."""
    done: list[tuple[T, R]] = []
    failed: list[Failure] = []
    for item in items:
        try:
            done.append((item, run(item)))
        except Exception as e:
            if is_step_fatal(e):
                raise
            failed.append(Failure(request_of(item), e))
    return done, failed
