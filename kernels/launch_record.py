"""The launch recorder: which compiled variant of each attention kernel a block of code
launches (test instrumentation; off, and free, unless a block records).

Triton compiles one binary per variant: the kernel, its tensors' dtypes, its constexprs and the
class it specialises each integer argument on (1, a multiple of 16, other). A variant first met
while serving is a compilation in the middle of a step, so the engine launches every variant
serving can need at start-up (``draftwise.kernels.launch_plan.warm_up_plan``);
``tests/engine/test_kernel_warm_up.py`` checks with :func:`recording_launches` that serving
launches none it did not. The kernel wrappers call :func:`note` before each launch. Imports no
Triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["LaunchKey", "note", "recording_launches"]

LaunchKey = tuple[object, ...]
"""``(kernel, (q, cache, out dtypes), integer classes, constexprs)``."""

_recording: set[LaunchKey] | None = None


@contextlib.contextmanager
def recording_launches() -> Iterator[set[LaunchKey]]:
    """Collect the compile key of every attention launch while the block runs."""
    global _recording
    outer, _recording = _recording, set()
    try:
        yield _recording
    finally:
        _recording = outer


def _int_class(v: int) -> str:
    return "1" if v == 1 else "16" if v % 16 == 0 else "n"


def note(
    kernel: str,
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    out: torch.Tensor,  # [T, H, D]
    ints: tuple[int, ...],
    constexprs: tuple[object, ...],
) -> None:
    """Record a launch's compile key when a :func:`recording_launches` block is open."""
    if _recording is None:
        return
    strides = (*q.stride()[:2], block_tables.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2])
    classes = tuple(_int_class(i) for i in (*ints, *strides))
    _recording.add((kernel, (q.dtype, k_cache.dtype, out.dtype), classes, constexprs))
