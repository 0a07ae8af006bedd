"""Lower-precision weights on CPU: a projection's weight packed once at load time and
multiplied with float32 activations.
Two modes:

``fp16``: the weight rounded to float16 (half the bytes of float32) and multiplied by this
package's kernel (``cpu_matmul``: float16 panels converted to float32 in registers) where it
runs, else by ``torch.ops.quantized.linear_dynamic_fp16`` (fbgemm does the same with its own
packing); both accumulate in float32, so only the weight's rounding differs from the float32
path (relative 2^-11 per weight).

``int8`` and ``int4``: weight-only 8- and 4-bit codes, per output and group of 32 inputs a float16 scale
and minimum (the weight is ``q * scale + min``, each group on the grid that holds it best:
``cpu_matmul.quantize``), multiplied by this package's kernel (codes widened, scaled and offset in
registers with one FMA); activations stay float32, so only the weight's rounding differs. 1.125 and
0.625 bytes a weight (0.28x and 0.16x float32's). Weights read from a GGUF file's Q4_1 and Q8_0 blocks
are held exactly by int8, and those of Q4_1 blocks by int4, so on such a file (SmolLM2's Q4_1 one,
its vocabulary in Q8_0) either mode computes what float32 does, bit for bit, from a quarter or a
sixth of the bytes; float weights round to half a step of their group's range over 255 or 15 steps. int4 packs
the LM head in int8 (as GGUF's 4-bit files keep the output and embedding at 6-8 bits: a 4-bit
vocabulary costs the most accuracy for the fewest bytes). Both need the kernel (no torch fallback:
torch's weight-only int8 CPU product, ``_weight_int8pack_mm``, ran 2.5x slower than float32 on this
project's AVX2 machine, and fbgemm's dynamic int8 quantizes the activations too: 42% argmax agreement
with float32 on SmolLM2-135M); a weight the kernel does not pack (output width not a multiple of its
panel, or inputs not of whole groups) keeps its codes' values as float32 (same results, float32's
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

QUANTIZATIONS = ("fp16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}


def check_supported(mode: str) -> None:
    """Raise ``ValueError`` (one line) unless this machine's torch can run ``mode``."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode in BITS:
        if cpu_matmul.kernel() is None:
            raise ValueError(
                f"quantization={mode!r} needs this package's CPU kernel, which is not available here "
                f"({cpu_matmul.unavailable_reason()}); use quantization='fp16' or none"
            )
        return
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(
            f"quantization={mode!r} needs fbgemm, PyTorch's x86 quantized GEMM library, which this torch build "
            f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)}); run without --quantization"
        )


class PackedWeight:
    """A ``[out, in]`` weight packed for this package's kernel (or fbgemm); ``matmul(x)`` = ``x @ w.T``
    for float32 ``x`` ``[T, in]``, no bias."""

    def __init__(
        self, weight: torch.Tensor, mode: str, codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        # weight [out, in], any float dtype; codes: cpu_matmul.quantize(weight, bits) where already made
        check_supported(mode)
        if weight.device.type != "cpu":
            raise ValueError(f"quantization={mode!r} runs on CPU only, got a weight on {weight.device}")
        w = weight.detach().to(torch.float32).contiguous()
        self.mode = mode
        self.out_features = w.shape[0]
        self.numel = w.numel()
        self._scales: torch.Tensor | None = None  # codes' float16 scales and minimums
        self._dense: torch.Tensor | None = None  # codes' values the kernel does not pack, dequantized
        self._packed = None
        if mode in BITS:
            bits = BITS[mode]
            self._panels = None
            if cpu_matmul.packs_quantized(*w.shape):
                q, scale, minimum = codes or cpu_matmul.quantize(w, bits)
                panels, sm = cpu_matmul.pack_codes(q, scale, minimum, bits)
                self._panels, self._scales = panels, sm
                self.nbytes = panels.numel() + 2 * sm.numel()
            else:  # the kernel cannot take it: its codes' values (where they exist), as float32
                fits = w.shape[1] % cpu_matmul.QUANT_GROUP == 0
                self._dense = cpu_matmul.dequantize(*cpu_matmul.quantize(w, bits)) if fits else w
                self.nbytes = w.numel() * 4
            return
        self.nbytes = w.numel() * 2
        # this package's kernel where it runs (float16 panels, converted in registers), else fbgemm
        self._panels = cpu_matmul.pack(w, torch.float16) if cpu_matmul.packs(self.out_features) else None
        self._packed = None if self._panels is not None else torch.ops.quantized.linear_prepack_fp16(w, None)

    @property
    def panels(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The kernel's panels and (codes) their scales and minimums, or None where the kernel does not multiply it."""
        return None if self._panels is None else (self._panels, self._scales)

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


EXACT_PROBE_ROWS = 64  # rows tried first: a weight on no 8-bit grid fails there, before the whole is quantized
EXACT_MODES = ("int8", "fp16")
"""What ``exact_codes`` tries, in order. Not int4, though it holds a Q4_1 block in half int8's bytes: a
one-row product is bound by widening codes, not by memory, on this project's 2-core AVX2 machine, and int4's
take more instructions (SmolLM2's Q4_1 file, batch-1 decode interleaved in one run: int8 51.8 / 48.5 / 44.3
tokens/s, int4 42.4 / 49.0 / 39.6; docs/models.md). ``--quantization int4`` keeps it where memory matters."""


def exact_codes(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` packed in int8 codes (``q * scale + min`` equal to every value) or float16 (every value a
    float16 one), whichever first holds it exactly (``EXACT_MODES``), so that every product is the float32 one
    bit for bit (the kernel forms each weight in registers and sums as its float32 products do); None where
    neither does, or the kernel cannot pack it. Weights dequantized from a GGUF file's Q4_1 or Q8_0 blocks take
    int8, a float16 checkpoint's fp16; float32 and bfloat16 values generally neither."""
    out_features, in_features = weight.shape
    if cpu_matmul.kernel() is None or not cpu_matmul.packs(out_features):
        return None
    w = weight.detach().to(torch.float32)
    for mode in EXACT_MODES:
        if mode == "fp16":
            if torch.equal(w.to(torch.float16).to(torch.float32), w):
                return PackedWeight(w, mode)
            continue
        probe = w[:EXACT_PROBE_ROWS]
        if in_features % cpu_matmul.QUANT_GROUP or not torch.equal(
            cpu_matmul.dequantize(*cpu_matmul.quantize(probe, BITS[mode])), probe
        ):
            continue
        codes = cpu_matmul.quantize(w, BITS[mode])
        if torch.equal(cpu_matmul.dequantize(*codes), w):
            return PackedWeight(w, mode, codes)
    return None
