"""Lower-precision weights on CPU: a projection's weight packed once at load time and
multiplied with float32 activations.
One mode so far:

``fp16``: the weight rounded to float16 (half the bytes of float32) and multiplied by this
package's kernel (``cpu_matmul``: float16 panels converted to float32 in registers) where it
runs, else by ``torch.ops.quantized.linear_dynamic_fp16`` (fbgemm does the same with its own
packing); both accumulate in float32, so only the weight's rounding differs from the float32
path (relative 2^-11 per weight).

On this project's 2-core AVX2 machine it beats every float32 kernel torch has, most where a
step multiplies a few rows at once (a verify pass of drafted tokens): docs/benchmarks.md,
section ``cpu-smollm2-135m-instruct``. Its tolerance against float32 is in docs/models.md
("Lower-precision weights on CPU") and tested in tests/model/test_cpu_weights.py.

No int8 or int4 mode: on this project's AVX2 machine torch's weight-only int8 and int4 CPU
kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) run 2.5x and 5x slower than
the float32 products, and fbgemm's dynamic int8 (activations quantized to 7 bits per call) agreed
with float32's argmax on 42% of SmolLM2-135M's positions (docs/benchmarks.md, section ``cpu-smollm2-135m-instruct``).

Only the products of the decoder layers and the LM head are packed; the embedding rows,
norms, attention and KV cache stay float32.
"""

from __future__ import annotations

from typing import Any

import torch

from draftwise.worker.model import cpu_matmul

QUANTIZATIONS = ("fp16",)


def check_supported(mode: str) -> None:
    """Raise ``ValueError`` (one line) unless this machine's torch can run ``mode``."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(
            f"quantization={mode!r} needs fbgemm, PyTorch's x86 quantized GEMM library, which this torch build "
            f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)}); run without --quantization"
        )


class PackedWeight:
    """A ``[out, in]`` weight packed for fbgemm; ``matmul(x)`` = ``x @ w.T`` for float32 ``x``
    ``[T, in]``, no bias."""

    def __init__(self, weight: torch.Tensor, mode: str) -> None:  # weight [out, in], any float dtype
        check_supported(mode)
        if weight.device.type != "cpu":
            raise ValueError(f"quantization={mode!r} runs on CPU only, got a weight on {weight.device}")
        w = weight.detach().to(torch.float32).contiguous()
        self.out_features = w.shape[0]
        self.numel = w.numel()
        self.nbytes = w.numel() * 2
        # this package's kernel where it runs (float16 panels, converted in registers), else fbgemm
        self._panels = cpu_matmul.pack(w, torch.float16) if cpu_matmul.packs(self.out_features) else None
        self._packed = None if self._panels is not None else torch.ops.quantized.linear_prepack_fp16(w, None)

    @property
    def kernel(self) -> str:
        return "fbgemm" if self._panels is None else "draftwise"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 -> [T, out] float32
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self._panels is not None:
            return cpu_matmul.matmul(x, self._panels)
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)

    def dense(self) -> torch.Tensor:  # [out, in] float32: the values the products use
        if self._panels is not None:
            return cpu_matmul.unpack(self._panels)
        w: Any = torch.ops.quantized.linear_unpack_fp16(self._packed)[0]
        return w.to(torch.float32)
