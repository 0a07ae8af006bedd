"""The one dispatch point for hot ops.

Every op has a torch reference twin (``draftwise.kernels.reference``) that runs on any
device. A faster implementation (Triton on CUDA) registers itself here for a device type;
``impl(op, device)`` picks it when one is registered and allowed, else the twin.

The Triton kernels register themselves for ``"cuda"`` when this module is imported on a
machine where CUDA is available and triton imports (:func:`register_triton`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import structlog
import torch

from draftwise.kernels import reference

log = structlog.get_logger("draftwise.kernels")

OPS = ("write_kv_cache", "paged_attention", "rms_norm", "rejection_accept")

_REFERENCE: dict[str, Callable[..., Any]] = {op: getattr(reference, op) for op in OPS}
# (op, device type) -> (backend name, implementation)
_FAST: dict[tuple[str, str], tuple[str, Callable[..., Any]]] = {}


def register(op: str, device_type: str, backend: str, fn: Callable[..., Any]) -> None:
    """Register a faster implementation of ``op`` for tensors on ``device_type``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    _FAST[(op, device_type)] = (backend, fn)


def backend_name(op: str, device: torch.device | str, prefer_reference: bool = False) -> str:
    """Which implementation ``impl`` would pick: ``"torch"`` (the twin) or a registered one."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    dev = torch.device(device)
    if prefer_reference or (op, dev.type) not in _FAST:
        return "torch"
    return _FAST[(op, dev.type)][0]


def impl(op: str, device: torch.device | str, prefer_reference: bool = False) -> Callable[..., Any]:
    """The implementation of ``op`` for tensors on ``device``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    dev = torch.device(device)
    if prefer_reference or (op, dev.type) not in _FAST:
        return _REFERENCE[op]
    return _FAST[(op, dev.type)][1]


def register_triton(device_type: str = "cuda") -> tuple[str, ...]:
    """Register every Triton kernel for ``device_type``; return the ops registered.

    Nothing is registered if triton does not import. Paged attention lives in its own module
    (``draftwise.kernels.triton_attention``); if that one fails to import, it is logged and
    skipped and the op keeps its twin, while the other kernels still register.
    """
    try:
        triton_ops = importlib.import_module("draftwise.kernels.triton_ops")
    except Exception as exc:  # triton missing or broken: every op keeps its twin
        log.warning("triton kernels unavailable; using the torch twins", error=repr(exc))
        return ()
    registered = ["write_kv_cache", "rms_norm", "rejection_accept"]
    for op in registered:
        register(op, device_type, "triton", getattr(triton_ops, op))
    try:
        from draftwise.kernels.triton_attention import paged_attention
    except Exception as exc:
        log.warning("triton paged attention unavailable; using the torch twin", error=repr(exc))
    else:
        register("paged_attention", device_type, "triton", paged_attention)
        registered.append("paged_attention")
    return tuple(registered)


if torch.cuda.is_available():
    register_triton()
