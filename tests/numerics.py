"""Float32 tolerances that mean the same on any CPU.

Different CPUs (and BLAS builds) pick different kernels for the same product, so float32 sums
round differently: a fixed absolute tolerance tuned on one machine fails on another, or is so
loose that it could not catch a real error. Instead, every float32 result is compared with an
*exact* reference (the same computation in float64) and its error is bounded by the error of a
*yardstick*: independent float32 computations of the same thing on the same machine
(transformers' own float32 forward pass; torch's own float32 products over both weight
layouts, since BLAS kernels for one product differ in accuracy by up to ~5x). The bound is

    FACTOR * max(max |yardstick - exact| over the yardsticks, EPS32 * max |exact|)

so it moves with the machine's rounding, and the test still fails for an error ``FACTOR`` times
the yardstick's (the measured ratio of our error to the yardstick's is in docs/engine.md,
"Floating point"). For logits the bound implies argmax agreement: wherever the exact top-two
gap is wider than twice the bound, no error within the bound can change the argmax (the greedy
tests compare the tokens themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FACTOR = 5.0
"""How many times the yardstick's own float32 error our error may be."""
EPS32 = float(torch.finfo(torch.float32).eps)
"""float32's machine epsilon: the floor of the yardstick's error, relative to the values' scale."""


@dataclass(frozen=True)
class Agreement:
    """How a float32 result stands against the exact (float64) one."""

    error: float  # max |ours - exact|
    yardstick_error: float  # max |yardstick - exact|: the same computation's float32 error elsewhere
    scale: float  # max |exact|
    bound: float  # what error may be
    vs_yardstick: float  # max |ours - yardstick|: what a direct comparison would see

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    @property
    def ratio(self) -> float:
        """Our error over the yardstick's (its floor): 1 means as accurate as the yardstick."""
        return self.error / max(self.yardstick_error, EPS32 * self.scale, 1e-300)

    def describe(self) -> str:
        return (
            f"max |ours - exact| = {self.error:.3g} (bound {self.bound:.3g} = {FACTOR:g} x the yardstick's "
            f"{self.yardstick_error:.3g}, floor {EPS32 * self.scale:.3g}); |ours - yardstick| = "
            f"{self.vs_yardstick:.3g}; scale {self.scale:.3g}"
        )


def error_bound(yardstick_error: float, scale: float, factor: float = FACTOR) -> float:
    return factor * max(yardstick_error, EPS32 * scale)


def agreement(
    ours: torch.Tensor,  # any shape
    exact: torch.Tensor,  # the same shape, float64
    *yardsticks: torch.Tensor,  # the same shape: independent float32 computations
) -> Agreement:
    """Measure ``ours`` against ``exact``, bounded by the yardsticks' own largest error."""
    assert exact.dtype == torch.float64, exact.dtype
    assert yardsticks and all(y.shape == ours.shape == exact.shape for y in yardsticks), (ours.shape, exact.shape)
    if not ours.numel():
        return Agreement(0.0, 0.0, 0.0, 0.0, 0.0)
    o = ours.double()
    err = (o - exact).abs().max().item()
    y_err = max((y.double() - exact).abs().max().item() for y in yardsticks)
    scale = exact.abs().max().item()
    vs_y = max((o - y.double()).abs().max().item() for y in yardsticks)
    return Agreement(err, y_err, scale, error_bound(y_err, scale), vs_y)


def assert_float32_agrees(
    ours: torch.Tensor, exact: torch.Tensor, *yardsticks: torch.Tensor, what: str = ""
) -> Agreement:
    a = agreement(ours, exact, *yardsticks)
    assert a.ok, f"{what}: {a.describe()}"
    return a


def closest_to_failing(agreements: list[Agreement]) -> Agreement:
    """Of several comparisons, the one whose error is the largest share of its bound."""
    assert agreements
    return max(agreements, key=lambda a: a.error / a.bound if a.bound else float("inf"))
