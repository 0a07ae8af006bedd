"""The float32 comparison the model tests use (``tests/numerics.py``): an error as large as the
yardstick's passes, one 10x larger fails, whatever the values' scale; an exact yardstick still
leaves float32's own rounding room."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import EPS32, FACTOR, agreement, assert_float32_agrees, closest_to_failing


def _case(scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(7, 50, generator=g, dtype=torch.float64) * scale
    noise = torch.randn(7, 50, generator=g, dtype=torch.float64)
    return exact, noise / noise.abs().max()  # noise: max |.| = 1


@pytest.mark.parametrize("scale", [1e-3, 1.0, 46.0, 1e4])
def test_a_10x_larger_error_fails_at_any_scale(scale: float) -> None:
    exact, noise = _case(scale)
    e = 30 * EPS32 * scale  # the yardstick's error: well above the floor
    yardstick = (exact + e * noise.roll(1, 0)).float()
    assert agreement((exact + e * noise).float(), exact, yardstick).ok
    assert agreement((exact + 2 * e * noise).float(), exact, yardstick).ok
    a = agreement((exact + 10 * e * noise).float(), exact, yardstick)
    assert not a.ok and a.error > a.bound
    with pytest.raises(AssertionError, match="bound"):
        assert_float32_agrees((exact + 10 * e * noise).float(), exact, yardstick, what="10x")


def test_the_worst_yardstick_sets_the_bound() -> None:
    exact, noise = _case(1.0)
    e = 100 * EPS32
    good, poor = (exact + e * noise).float(), (exact + 3 * e * noise).float()
    ours = (exact + 8 * e * noise).float()
    assert not agreement(ours, exact, good).ok
    assert agreement(ours, exact, good, poor).ok  # 8 < 5 x 3


def test_an_exact_yardstick_leaves_float32_rounding() -> None:
    exact, _ = _case(46.0)
    rounded = exact.float()  # the closest float32 values: error <= eps/2 * |x|
    a = agreement(rounded, exact, rounded)
    assert a.ok and a.bound == pytest.approx(FACTOR * EPS32 * a.scale)
    off = exact + 6 * EPS32 * a.scale  # beyond FACTOR x float32's epsilon at the scale
    assert not agreement(off, exact, rounded).ok


def test_closest_to_failing_picks_the_largest_share_of_its_bound() -> None:
    exact, noise = _case(1.0)
    y = (exact + 1e-5 * noise).float()
    small = agreement((exact + 1e-5 * noise).float(), exact, y)
    near = agreement((exact + 4e-5 * noise).float(), exact, y)
    assert closest_to_failing([small, near]) is near
