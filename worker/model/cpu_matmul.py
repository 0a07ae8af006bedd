"""Weight-streaming products on CPU: this package's own AVX2 kernel (``cpu_matmul.cpp``) for
``x @ W.T`` with float32, float16 or int8 weights (int8: a float32 scale per output and group of 32 inputs).

A decode step multiplies one row, or a few (a verify pass of drafted tokens, a small batch), by
every weight, so it costs what streaming the weights from memory costs. PyTorch's CPU products
read a weight once per row or few rows for such shapes: on this project's 2-core machine a
4-row product over SmolLM2-135M's weights took 1.6x a 1-row one. The kernel reads each
weight once per call for up to 6 rows (from cache after that), so 1-5 rows cost about the same,
and it beats torch's float32 products at every row count measured (1-64; 512 ad hoc) and
fbgemm's float16 one at 1-5 rows (docs/benchmarks.md, section ``cpu-smollm2-135m-instruct``).

The weight is packed once, at load time, into panels of ``PANEL`` output columns:
``[out / PANEL, in, PANEL]``, each panel one contiguous stream (``pack``). Only weights whose
output width is a multiple of ``PANEL`` are packed (every projection and vocabulary of the
models we load; others keep torch's products).

The kernel is compiled from its source with the machine's C++ compiler the first time it is
needed (a second or two) and cached under ``draftwise_cache_dir()/kernels``, keyed by the
source, the compiler and its flags. It needs x86-64 with AVX2, FMA and F16C, and ``g++`` (or
``$CXX``); without them, or with ``DRAFTWISE_CPU_KERNELS=0``, the products are torch's, as
before, and ``unavailable_reason()`` says why. It runs its threads on PyTorch's own OpenMP
runtime (linked by soname against the ``libgomp.so.1`` torch has loaded), with
``torch.get_num_threads()`` threads.

Results: float32 accumulation, in blocks of 128 inputs (each summed in input order, the blocks'
sums added in order), so they differ from torch's in rounding only, and by no more than BLAS's
own products differ from exact (tests/numerics.py; tests/model/test_cpu_matmul.py).

The library has two of a layer's small ops too (``rope_``, ``rms_norm``): one call each instead of
the handful of torch ops, and their Python overhead, they replace (tests/model/test_cpu_ops.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from draftwise.kernels import reference
from draftwise.worker.paths import draftwise_cache_dir

PANEL = 16  # output columns per panel (the kernel's dw_panel_width)
ENV = "DRAFTWISE_CPU_KERNELS"  # "0": use torch's products
PROFILER_NAME = "draftwise::cpu_matmul"  # what torch's profiler records a call as
SOURCE = Path(__file__).with_name("cpu_matmul.cpp")
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded kernel, or "reason": why there is none


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _build(cxx: str) -> Path:
    """The compiled kernel, from the cache or compiled now (atomically: processes that start
    together each compile to a file of their own and rename it into place)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:20]
    folder = draftwise_cache_dir() / "kernels"
    target = folder / f"cpu_matmul-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the kernel is x86-64 code; this machine is {platform.machine()}")
    missing = [f for f in NEEDED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(missing)}")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH to build it")
    lib = ctypes.CDLL(str(_build(cxx)))
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    for fn in (lib.dw_matmul_f32, lib.dw_matmul_f16):
        fn.argtypes = [*args, ctypes.c_int]
        fn.restype = None
    lib.dw_matmul_i8.argtypes = [*args, ctypes.c_int, ctypes.c_void_p]
    lib.dw_matmul_i8.restype = None
    if lib.dw_int8_group() != INT8_GROUP:
        raise RuntimeError(f"the kernel's int8 group is {lib.dw_int8_group()}, this module's {INT8_GROUP}")
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.dw_rms_norm_f32.argtypes = [p, p, p, f32, i64, i64, p, p, ctypes.c_int]
    lib.dw_rms_norm_f32.restype = None
    lib.dw_rope_f32.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.dw_rope_f32.restype = None
    if lib.dw_panel_width() != PANEL:
        raise RuntimeError(f"the kernel's panel width is {lib.dw_panel_width()}, this module's {PANEL}")
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, or None (``unavailable_reason`` says why). Built once per process;
    ``DRAFTWISE_CPU_KERNELS=0`` is read on every call."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    lib = _state.get("lib")  # built: no lock on the per-product path
    if isinstance(lib, ctypes.CDLL):
        return lib
    with _lock:
        if not _state:
            try:
                _state["lib"] = _load()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _state["reason"] = str(e)
        lib = _state.get("lib")
    return lib if isinstance(lib, ctypes.CDLL) else None


def unavailable_reason() -> str | None:
    """Why the products are torch's (None: the kernel is in use)."""
    if os.environ.get(ENV, "1").strip() == "0":
        return f"{ENV}=0"
    return None if kernel() is not None else str(_state.get("reason"))


def packs(out_features: int) -> bool:
    """Whether a weight with ``out_features`` outputs is packed for the kernel on this machine."""
    return out_features % PANEL == 0 and kernel() is not None


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[out, in]`` -> panels ``[out / PANEL, in, PANEL]`` of ``dtype`` (float32 or float16), contiguous."""
    out_features, in_features = weight.shape
    if out_features % PANEL or dtype not in (torch.float32, torch.float16):
        raise ValueError(f"cannot pack a [{out_features}, {in_features}] weight as {dtype} panels of {PANEL}")
    w = weight.detach().to(dtype)
    return w.reshape(out_features // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


INT8_GROUP = 32  # inputs per int8 scale (the kernel's dw_int8_group), as GGUF's Q8_0


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` (``in`` a multiple of INT8_GROUP) -> (int8 ``[out, in]``, float32 scales ``[out, in /
    INT8_GROUP]``): symmetric, per output and group of INT8_GROUP inputs, ``scale = max|w| / 127`` (1 for an
    all-zero group), values rounded to nearest. The weight's value is ``q * scale``."""
    w = weight.detach().to(torch.float32)
    out_features, in_features = w.shape
    if in_features % INT8_GROUP:
        raise ValueError(f"int8: {in_features} inputs are not a multiple of the group of {INT8_GROUP}")
    g = w.reshape(out_features, in_features // INT8_GROUP, INT8_GROUP)
    scale = g.abs().amax(dim=2) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8).reshape(out_features, in_features)
    return q, scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` ``[out, in]`` float32 (each scale over its group of INT8_GROUP inputs)."""
    return q.to(torch.float32) * scale.repeat_interleave(INT8_GROUP, dim=1)


def packs_int8(out_features: int, in_features: int) -> bool:
    """Whether an ``[out, in]`` weight is packed as int8 for the kernel on this machine."""
    return in_features % INT8_GROUP == 0 and packs(out_features)


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` -> int8 panels ``[out / PANEL, in, PANEL]`` and their scales ``[out / PANEL, in /
    INT8_GROUP, PANEL]`` (``quantize_int8``), both contiguous."""
    out_features, in_features = weight.shape
    if out_features % PANEL:
        raise ValueError(f"cannot pack a [{out_features}, {in_features}] weight as int8 panels of {PANEL}")
    q, scale = quantize_int8(weight)
    panels = q.reshape(out_features // PANEL, PANEL, in_features).transpose(1, 2).contiguous()
    groups = in_features // INT8_GROUP
    return panels, scale.reshape(out_features // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Panels ``[P, in, PANEL]`` -> ``[P * PANEL, in]`` float32 (a copy; int8 panels times their ``scales``)."""
    w = panels.transpose(1, 2).reshape(-1, panels.shape[1])
    if scales is None:
        return w.to(torch.float32)
    return dequantize_int8(w, scales.transpose(1, 2).reshape(w.shape[0], -1))


def matmul(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[T, in]`` float32 and ``W``'s panels (``pack``; int8 panels with
    their per-output ``scales``, ``pack_int8``): ``[T, out]`` float32. Only call when ``kernel()``
    is not None."""
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"the CPU kernel is not available: {unavailable_reason()}")
    num_panels, in_features, width = panels.shape
    if x.dim() != 2 or x.shape[1] != in_features or width != PANEL or not panels.is_contiguous():
        raise ValueError(f"matmul: x {list(x.shape)} against panels {list(panels.shape)}")
    if panels.dtype not in (torch.float16, torch.float32, torch.int8):
        raise ValueError(f"matmul: panels of {panels.dtype}")
    int8 = panels.dtype == torch.int8
    want = (num_panels, in_features // INT8_GROUP, PANEL)
    if int8 != (scales is not None) or (
        scales is not None
        and (
            in_features % INT8_GROUP
            or scales.dtype != torch.float32
            or tuple(scales.shape) != want
            or not scales.is_contiguous()
        )
    ):
        raise ValueError(f"matmul: int8 panels need their float32 scales {list(want)}, other panels none")
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], num_panels * PANEL, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    args = (x.data_ptr(), x.shape[0], in_features, panels.data_ptr(), num_panels * PANEL, y.data_ptr())
    if int8:
        assert scales is not None
        fn, extra = lib.dw_matmul_i8, (torch.get_num_threads(), scales.data_ptr())
    else:
        fn = lib.dw_matmul_f16 if panels.dtype == torch.float16 else lib.dw_matmul_f32
        extra = (torch.get_num_threads(),)
    if torch.autograd.profiler._is_profiler_enabled:  # seen by torch's profiler (bench_profile, tests)
        with torch.profiler.record_function(PROFILER_NAME):
            fn(*args, *extra)
    else:
        fn(*args, *extra)
    return y


def _plain_f32(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in ts)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rms_norm`` op (``draftwise.kernels.reference.rms_norm``: ``(normed, x + residual)``)
    in one pass per row, for float32 tensors on CPU without gradients; anything else, or no
    kernel, goes to the torch twin. Rounding differs from torch's in the sum of squares only."""
    f32 = torch.float32
    if (
        x.dtype != f32
        or weight.dtype != f32
        or x.device.type != "cpu"
        or x.dim() != 2
        or weight.shape != x.shape[1:]
        or (residual is not None and residual.shape != x.shape)
        or x.requires_grad
        or weight.requires_grad
        or (residual is not None and (residual.dtype != f32 or residual.requires_grad))
        or (lib := kernel()) is None
    ):
        return reference.rms_norm(x, weight, eps, residual)
    x = x.contiguous()
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if residual is None:
        res_out, res_ptr, res_out_ptr = x, None, None
    else:
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
        res_ptr, res_out_ptr = residual.data_ptr(), res_out.data_ptr()
    w = weight.contiguous()
    lib.dw_rms_norm_f32(
        x.data_ptr(), res_ptr, w.data_ptr(), eps, rows, hidden, out.data_ptr(), res_out_ptr, torch.get_num_threads()
    )
    return out, res_out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x`` ([T, heads, D], rows of any stride, each row's heads contiguous) in place by
    ``cos``/``sin`` ([T, 1, D] contiguous), bit-identical to ``rope.apply_rope``. Returns False
    (``x`` untouched) where the kernel does not apply: no kernel, not float32 on CPU, gradients,
    another layout."""
    lib = kernel()
    t, heads, d = x.shape
    if (
        lib is None
        or not _plain_f32(x, cos, sin)
        or d % 2
        or x.stride(2) != 1
        or x.stride(1) != d
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != (t, 1, d)
        or sin.shape != (t, 1, d)
    ):
        return False
    lib.dw_rope_f32(x.data_ptr(), t, x.stride(0), heads, d, cos.data_ptr(), sin.data_ptr())
    return True
