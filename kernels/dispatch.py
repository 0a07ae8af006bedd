"""The one dispatch point for hot ops.

Every op has a torch reference twin (``draftwise.kernels.reference``) that runs on any
device. A faster implementation (Triton on CUDA) registers itself here for a device type;
``impl(op, device)`` picks it when one is registered and allowed, else the twin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from draftwise.kernels import reference

OPS = ("write_kv_cache", "paged_attention", "rms_norm")

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
