"""Keep freed host memory in the process, so that a step's large temporaries are reused.

On CPU a forward pass allocates and frees the same large temporaries every step (the keys
and values attention gathers, the MLP's intermediates, the logits): several MiB each. glibc
serves blocks above its mmap threshold with a fresh ``mmap`` and gives them back with
``munmap`` on free (and trims the top of its heap when enough is free there), so every step
the kernel hands out those pages again, zeroed, one page fault per 4 KiB. At batch 64 with
contexts of a few hundred tokens that was three quarters of a decode step on the 2-core
development VM (120 ms against 30 ms; docs/benchmarks.md).

:func:`retain_freed_memory` raises the mmap threshold to glibc's largest (32 MiB on 64-bit)
and the trim threshold to 1 GiB, so freed blocks stay in the heap and the next step's
allocations reuse them without faulting. The cost is a resident size that stays at its high
mark. It is process-wide; ``EngineConfig.retain_freed_memory`` (default on) decides whether
an engine applies it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import structlog

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "retain_freed_memory"]

log = structlog.get_logger("draftwise.host_memory")

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring); whether both took
    effect (False off Linux or without glibc's ``mallopt``: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("could not set malloc thresholds; freed memory goes back to the kernel")
    return ok
