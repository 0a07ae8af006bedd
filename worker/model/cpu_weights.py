"""Lower-precision weights on CPU: a projection's weight packed once at load time and
multiplied with float32 activations.
Two modes:

``fp16``: the weight rounded to float16 (half the bytes of float32) and multiplied by this
package's kernel (``cpu_matmul``: float16 panels converted to float32 in registers) where it
runs, else by ``torch.ops.quantized.linear_dynamic_fp16`` (fbgemm does the same with its own
packing); both accumulate in float32, so only the weight's rounding differs from the float32
path (relative 2^-11 per weight).

``int8``: weight-only int8, symmetric per output and group of 32 inputs (``scale = max|w| / 127``
over the group, as GGUF's Q8_0; 1.125 bytes a weight with the float32 scales, 0.28x float32's),
multiplied by this package's kernel (int8 panels converted and scaled in registers); activations
stay float32, so only the weight's rounding (half a scale step) differs. (One scale per output
channel agreed with float32's argmax on 94.8% of SmolLM2-135M's positions, groups of 32 on 97.2%.) It needs
the kernel (no torch fallback here: torch's weight-only int8 CPU product,
``_weight_int8pack_mm``, ran 2.5x slower than float32 on this project's AVX2 machine, and
fbgemm's dynamic int8 quantizes the activations too: 42% argmax agreement with float32 on
SmolLM2-135M); a weight the kernel does not pack (output width not a multiple of its panel, or
inputs not of whole groups) keeps its int8 values dequantized to float32 (same results, float32's
bytes), or its float32 values where its inputs are not whole groups.

On this project's 2-core AVX2 machine both beat every float32 kernel torch has, most where a
step multiplies a few rows at once (a verify pass of drafted tokens): docs/benchmarks.md,
section ``cpu-smollm2-135m-instruct``. Their tolerance against float32 is in docs/models.md
("Lower-precision weights on CPU") and tested in tests/model/test_cpu_weights.py.

Only the products of the decoder layers and the LM head are packed; the embedding rows,
norms, attention and KV cache stay float32.
"""

from __future__ import annotations

from typing import Any

import torch

from draftwise.worker.model import cpu_matmul

QUANTIZATIONS = ("fp16", "int8")


def check_supported(mode: str) -> None:
    """Raise ``ValueError`` (one line) unless this machine's torch can run ``mode``."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "int8":
        if cpu_matmul.kernel() is None:
            raise ValueError(
                f"quantization='int8' needs this package's CPU kernel, which is not available here "
                f"({cpu_matmul.unavailable_reason()}); use quantization='fp16' or none"
            )
        return
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
        self.mode = mode
        self.out_features = w.shape[0]
        self.numel = w.numel()
        self._scales: torch.Tensor | None = None
        self._dense: torch.Tensor | None = None  # int8 values the kernel does not pack, dequantized
        self._packed = None
        if mode == "int8":
            self._panels = None
            if cpu_matmul.packs_int8(*w.shape):
                self._panels, self._scales = cpu_matmul.pack_int8(w)
                self.nbytes = w.numel() + 4 * self._scales.numel()
            else:  # the kernel cannot take it: its int8 values (where they exist), as float32
                fits = w.shape[1] % cpu_matmul.INT8_GROUP == 0
                self._dense = cpu_matmul.dequantize_int8(*cpu_matmul.quantize_int8(w)) if fits else w
                self.nbytes = w.numel() * 4
            return
        self.nbytes = w.numel() * 2
        # this package's kernel where it runs (float16 panels, converted in registers), else fbgemm
        self._panels = cpu_matmul.pack(w, torch.float16) if cpu_matmul.packs(self.out_features) else None
        self._packed = None if self._panels is not None else torch.ops.quantized.linear_prepack_fp16(w, None)

    @property
    def kernel(self) -> str:
        if self._panels is not None:
            return "draftwise"
        return "torch" if self._dense is not None else "fbgemm"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 -> [T, out] float32
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self._panels is not None:
            return cpu_matmul.matmul(x, self._panels, self._scales)
        if self._dense is not None:
            return torch.nn.functional.linear(x, self._dense)
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)

    def dense(self) -> torch.Tensor:  # [out, in] float32: the values the products use
        if self._panels is not None:
            return cpu_matmul.unpack(self._panels, self._scales)
        if self._dense is not None:
            return self._dense.clone()
        w: Any = torch.ops.quantized.linear_unpack_fp16(self._packed)[0]
        return w.to(torch.float32)
