"""Weight-streaming products on CPU: this package's own AVX2 kernel (``cpu_matmul.cpp``) for
``x @ W.T`` with float32, float16, 8-bit or 4-bit weights (the codes' float16 scale and minimum per output
and group of 32 inputs).

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
before, and ``unavailable_reason()`` says why. It runs ``torch.get_num_threads()`` threads on a pool of
its own (``cpu_pool.cpp``: its workers spin between a step's products, from whichever thread calls;
libgomp, which it used before, stopped spinning once a second thread started regions, and a decode step
on the engine's thread ran at half speed).

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
SOURCES = tuple(Path(__file__).with_name(f"cpu_{name}.cpp") for name in ("matmul", "attention", "layer", "pool"))
HEADERS = tuple(Path(__file__).with_name(f"cpu_{name}.h") for name in ("simd", "pool"))
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
AVX512_ENV = "DRAFTWISE_CPU_AVX512"  # "0": build the products for AVX2 even where the CPU has AVX-512

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


def has_avx512() -> bool:
    """Whether this CPU runs the library's 512-bit products (AVX-512 F, BW, VL and DQ)."""
    flags = _cpu_flags()
    return all(f in flags for f in AVX512_CPU_FLAGS)


def use_avx512() -> bool:
    """Whether the library is built with its 512-bit products: where the CPU has them, unless
    ``DRAFTWISE_CPU_AVX512=0``. Same results bit for bit; on a core with 512-bit FMA units (Zen 5)
    a compute-bound product takes about half the time (docs/models.md)."""
    return os.environ.get(AVX512_ENV, "1").strip() != "0" and has_avx512()


def build_flags(avx512: bool) -> tuple[str, ...]:
    return FLAGS + AVX512_FLAGS if avx512 else FLAGS


def _build(cxx: str, avx512: bool | None = None) -> Path:
    """The compiled kernel (``avx512``: with its 512-bit products; None: ``use_avx512()``), from the
    cache or compiled now (atomically: processes that start together each compile to a file of their
    own and rename it into place)."""
    flags = build_flags(use_avx512() if avx512 is None else avx512)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + version.encode() + " ".join(flags).encode()).hexdigest()[:20]
    folder = draftwise_cache_dir() / "kernels"
    target = folder / f"cpu_matmul-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def open_library(path: Path) -> ctypes.CDLL:
    """The compiled library at ``path`` with its products' signatures declared (``dw_matmul_*``,
    ``dw_vector_bits``); ``_load`` declares the rest and checks it against this module."""
    lib = ctypes.CDLL(str(path))
    lib.dw_vector_bits.restype = ctypes.c_int
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    for fn in (lib.dw_matmul_f32, lib.dw_matmul_f16):
        fn.argtypes = [*args, ctypes.c_int]
        fn.restype = None
    for fn in (lib.dw_matmul_q8, lib.dw_matmul_q4):
        fn.argtypes = [*args, ctypes.c_int, ctypes.c_void_p]
        fn.restype = None
    return lib


def _load() -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the kernel is x86-64 code; this machine is {platform.machine()}")
    missing = [f for f in NEEDED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(missing)}")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH to build it")
    lib = open_library(_build(cxx))
    if lib.dw_quant_group() != QUANT_GROUP:
        raise RuntimeError(f"the kernel's quantization group is {lib.dw_quant_group()}, this module's {QUANT_GROUP}")
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.dw_rms_norm_f32.argtypes = [p, p, p, f32, i64, i64, p, p, ctypes.c_int]
    lib.dw_rms_norm_f32.restype = None
    lib.dw_rope_f32.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.dw_rope_f32.restype = None
    lib.dw_paged_attention_f32.argtypes = [p, i64, p, p, *[i64] * 4, p, p, p, i64, p, i64, f32, i64, p, ctypes.c_int]
    lib.dw_paged_attention_f32.restype = None
    lib.dw_write_kv_f32.argtypes = [p, i64, p, i64, p, i64, i64, p, p, i64]
    lib.dw_write_kv_f32.restype = i64
    lib.dw_layer_scratch.argtypes = [p, i64]
    lib.dw_layer_scratch.restype = i64
    lib.dw_layer_forward.argtypes = [p] * 9
    lib.dw_layer_forward.restype = i64
    lib.dw_pool_workers.restype = ctypes.c_int
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


def vector_bits() -> int:
    """512 when the products run on AVX-512, 256 on AVX2, 0 without the kernel."""
    lib = kernel()
    return 0 if lib is None else int(lib.dw_vector_bits())


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


QUANT_GROUP = 32  # inputs per scale and minimum of 8- and 4-bit weights (the kernel's dw_quant_group), as GGUF's blocks
QUANT_BITS = (8, 4)
_QUANT_ROWS = 2048  # rows quantized at a time (bounds the float64 temporaries of a large vocabulary)


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[out, in]`` (``in`` a multiple of QUANT_GROUP) -> (codes uint8 ``[out, in]`` in ``0 .. 2**bits - 1``,
    float16 scales and minimums ``[out, in / QUANT_GROUP]``): per output and group of QUANT_GROUP inputs, the
    weight's value is ``q * scale + min`` (``dequantize``).

    Each group takes whichever of a few grids represents it with the smallest largest error: its range in
    ``2**bits - 1`` steps (asymmetric, as GGUF's Q4_1 and Q8_1 blocks); for 8 bits also its range in 15 steps
    and ``max|w| / 127`` steps about zero (a 4-bit block's and a Q8_0 block's own grids). So weights read from
    a GGUF file of Q4_0/Q4_1/Q8_0 blocks (aligned groups of 32) are held exactly, and others to half a step.
    Raises ``ValueError`` where a scale or minimum is beyond float16's range."""
    if bits not in QUANT_BITS:
        raise ValueError(f"quantize: bits must be one of {QUANT_BITS}, got {bits}")
    out_features, in_features = weight.shape
    if in_features % QUANT_GROUP:
        raise ValueError(f"int{bits}: {in_features} inputs are not a multiple of the group of {QUANT_GROUP}")
    parts = [_quantize_rows(weight[i : i + _QUANT_ROWS], bits) for i in range(0, out_features, _QUANT_ROWS)]
    return tuple(torch.cat(t) for t in zip(*parts, strict=True))  # type: ignore[return-value]


def _quantize_rows(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, in_features = weight.shape
    g = weight.detach().to(torch.float64).reshape(rows, in_features // QUANT_GROUP, QUANT_GROUP)
    low, high = g.amin(dim=2), g.amax(dim=2)
    top = 2**bits - 1
    grids = [((high - low) / top, low)]
    if bits == 8:
        step = g.abs().amax(dim=2) / 127
        grids += [((high - low) / 15, low), (step, -128 * step)]
    best = None
    for scale, minimum in grids:
        s16, m16 = scale.to(torch.float16), minimum.to(torch.float16)
        if not (torch.isfinite(s16).all() and torch.isfinite(m16).all()):
            raise ValueError(
                f"int{bits}: a group of weights spans more than float16's range (max |w| {g.abs().max():.3g})"
            )
        s, m = s16.to(torch.float64)[..., None], m16.to(torch.float64)[..., None]
        q = torch.where(s > 0, (g - m) / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(0, top)
        err = ((q * s + m).to(torch.float32).to(torch.float64) - g).abs().amax(dim=2)
        if best is None:
            best = (q, s16, m16, err)
            continue
        better = err < best[3]
        best = (
            torch.where(better[..., None], q, best[0]),
            torch.where(better, s16, best[1]),
            torch.where(better, m16, best[2]),
            torch.minimum(err, best[3]),
        )
    assert best is not None
    q, s16, m16, _ = best
    return q.to(torch.uint8).reshape(rows, in_features), s16, m16


def dequantize(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """``q * scale + min`` ``[out, in]`` float32, each rounded once from its exact value (as the kernel's FMA
    forms it: the product of an 8-bit code and a float16 scale, plus a float16, is exact in float64)."""
    s = scale.to(torch.float64).repeat_interleave(QUANT_GROUP, dim=1)
    m = minimum.to(torch.float64).repeat_interleave(QUANT_GROUP, dim=1)
    return (q.to(torch.float64) * s + m).to(torch.float32)


def packs_quantized(out_features: int, in_features: int) -> bool:
    """Whether an ``[out, in]`` weight is packed as 8- or 4-bit codes for the kernel on this machine."""
    return in_features % QUANT_GROUP == 0 and packs(out_features)


def pack_quantized(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` -> code panels uint8 ``[out / PANEL, in, PANEL * bits / 8]`` (4 bits: output ``j`` of a
    panel in the low nibble of byte ``j``, output ``j + 8`` in its high nibble) and their float16 scales and
    minimums ``[out / PANEL, in / QUANT_GROUP, 2, PANEL]`` (``quantize``), both contiguous."""
    out_features, in_features = weight.shape
    if out_features % PANEL:
        raise ValueError(f"cannot pack a [{out_features}, {in_features}] weight as int{bits} panels of {PANEL}")
    return pack_codes(*quantize(weight, bits), bits)


def pack_codes(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize``'s codes, scales and minimums -> ``pack_quantized``'s panels and their scales and minimums."""
    out_features, in_features = q.shape
    if out_features % PANEL or bits not in QUANT_BITS or (q.numel() and int(q.max()) >= 2**bits):
        raise ValueError(f"cannot pack [{out_features}, {in_features}] codes as int{bits} panels of {PANEL}")
    panels = q.reshape(out_features // PANEL, PANEL, in_features).transpose(1, 2)
    if bits == 4:
        panels = panels[..., : PANEL // 2] | (panels[..., PANEL // 2 :] << 4)
    groups = in_features // QUANT_GROUP
    sm = torch.stack([scale, minimum], dim=1).reshape(out_features // PANEL, PANEL, 2, groups)
    return panels.contiguous(), sm.permute(0, 3, 2, 1).contiguous()


def _codes(panels: torch.Tensor) -> torch.Tensor:
    """Code panels (``pack_quantized``) -> codes ``[P, in, PANEL]``."""
    if panels.shape[2] == PANEL:
        return panels
    return torch.cat([panels & 0x0F, panels >> 4], dim=2)


def unpack(panels: torch.Tensor, sm: torch.Tensor | None = None) -> torch.Tensor:
    """Panels ``[P, in, PANEL]`` -> ``[P * PANEL, in]`` float32 (a copy; code panels with their scales and
    minimums ``sm``: ``dequantize``)."""
    if sm is None:
        return panels.transpose(1, 2).reshape(-1, panels.shape[1]).to(torch.float32)
    q = _codes(panels).transpose(1, 2).reshape(-1, panels.shape[1])
    scale, minimum = (sm[:, :, i].transpose(1, 2).reshape(q.shape[0], -1) for i in (0, 1))
    return dequantize(q, scale, minimum)


def matmul(x: torch.Tensor, panels: torch.Tensor, sm: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[T, in]`` float32 and ``W``'s panels (``pack``; 8- or 4-bit code panels with
    their scales and minimums ``sm``, ``pack_quantized``): ``[T, out]`` float32. Only call when ``kernel()``
    is not None."""
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"the CPU kernel is not available: {unavailable_reason()}")
    num_panels, in_features, width = panels.shape
    codes = panels.dtype == torch.uint8
    bits = 8 * width // PANEL if codes else 0
    if x.dim() != 2 or x.shape[1] != in_features or width != (PANEL * bits // 8 if codes else PANEL):
        raise ValueError(f"matmul: x {list(x.shape)} against panels {list(panels.shape)} of {panels.dtype}")
    if not panels.is_contiguous() or panels.dtype not in (torch.float16, torch.float32, torch.uint8):
        raise ValueError(f"matmul: panels of {panels.dtype} (contiguous: {panels.is_contiguous()})")
    want = (num_panels, in_features // QUANT_GROUP, 2, PANEL)
    if codes != (sm is not None) or (
        sm is not None
        and (
            in_features % QUANT_GROUP or sm.dtype != torch.float16 or tuple(sm.shape) != want or not sm.is_contiguous()
        )
    ):
        raise ValueError(f"matmul: code panels need their float16 scales and minimums {list(want)}, other panels none")
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], num_panels * PANEL, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    args = (x.data_ptr(), x.shape[0], in_features, panels.data_ptr(), num_panels * PANEL, y.data_ptr())
    if sm is not None:
        fn, extra = (lib.dw_matmul_q8 if bits == 8 else lib.dw_matmul_q4), (torch.get_num_threads(), sm.data_ptr())
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
