"""Counter-based randomness: every random number is a pure function of (seed, position,
stream, index), computed with a handful of integer tensor ops over a whole batch at once.

A request's randomness is keyed by its 64-bit seed and the absolute position ``t`` of the
token being chosen (``t`` = prompt length + output index), never by how many numbers were
drawn before; so the same (seed, position) draws the same numbers in any batch, with any
speculation length, on any worker, after any restart.

Construction: per row, two 32-bit keys are absorbed from (stream, seed low, seed high,
position) by two independent chains of the ``lowbias32`` integer hash (C. Wellons' hash
prospector: xor-shift, multiply, xor-shift, multiply, xor-shift; a bijection on 32 bits);
per entry ``i`` of a row the bits are ``mix(mix(i ^ key_a) ^ key_b)``. Everything runs on
int64 tensors holding 32-bit values, with multipliers in signed 32-bit form, so no product
overflows (``|x * c| < 2**63``) and ``& 0xFFFFFFFF`` keeps the exact low 32 bits: the
results are identical on every device and platform.

Streams keep the numbers of different uses independent: :data:`STREAM_SAMPLE` (the target's
choice of the token at ``t``), :data:`STREAM_DRAFT` (a draft model's proposal at ``t`` for a
request verified by rejection sampling), :data:`STREAM_ACCEPT` (rejection sampling's accept
test at ``t``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_SAMPLE",
    "keyed_bits",
    "keyed_exponential",
    "keyed_uniform",
    "seed_halves",
]

STREAM_SAMPLE = 0
"""The target's draw of the token at a position (plain sampling, seeded speculation, the
recovered or bonus token of rejection sampling)."""
STREAM_DRAFT = 1
"""A draft model's draw at a position, for requests verified by rejection sampling."""
STREAM_ACCEPT = 2
"""The uniform of rejection sampling's accept test at a position."""

_MASK32 = 0xFFFFFFFF
_SEED_MASK = (1 << 64) - 1
_MAX_POSITION = 1 << 32


def _signed32(c: int) -> int:
    """``c`` (32 bits) as a signed 32-bit value: the same product modulo 2**32, no int64 overflow."""
    return c - (1 << 32) if c >= 1 << 31 else c


_MUL1 = _signed32(0x7FEB352D)
_MUL2 = _signed32(0x846CA68B)
_LANE_A = 0x9E3779B9  # initial states of the two key chains (golden ratio, pi digits)
_LANE_B = 0x243F6A88


def _mix32_(x: torch.Tensor) -> torch.Tensor:  # int64, values in [0, 2**32), modified in place
    """lowbias32, in place: a bijection of [0, 2**32) with good avalanche."""
    x ^= x >> 16
    x *= _MUL1
    x &= _MASK32
    x ^= x >> 15
    x *= _MUL2
    x &= _MASK32
    x ^= x >> 16
    return x


def seed_halves(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:  # [R, 2] int64
    """Each seed modulo 2**64 (so -1 and 2**64 - 1 are one seed) as its (low, high) 32-bit halves."""
    vals = [int(s) & _SEED_MASK for s in seeds]
    return torch.tensor([[v & _MASK32, v >> 32] for v in vals], dtype=torch.int64, device=device).view(len(vals), 2)


def _row_keys(
    halves: torch.Tensor,  # [R, 2] int64
    positions: torch.Tensor,  # [R] int64
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # key_a [R, 1], key_b [R, 1]
    keys = []
    for lane in (_LANE_A, _LANE_B):
        h = torch.full_like(positions, lane ^ stream)  # [R]
        for word in (halves[:, 0], halves[:, 1], positions):
            h ^= word
            _mix32_(h)
        keys.append(h.unsqueeze(1))
    return keys[0], keys[1]


def keyed_bits(
    seeds: Sequence[int],  # per row
    positions: torch.Tensor | Sequence[int],  # [R] absolute positions, in [0, 2**32)
    stream: int,
    width: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [R, width] int64 in [0, 2**32)
    """32 random bits for entries ``0..width-1`` of each row, a pure function of (seed,
    position, stream, entry); entry ``i`` does not depend on ``width``."""
    if not isinstance(positions, torch.Tensor):  # a device tensor is trusted: checking it would sync
        bad = [p for p in positions if not 0 <= int(p) < _MAX_POSITION]
        if bad:
            raise ValueError(f"positions must be in [0, 2**32), got {bad[0]}")
    pos = torch.as_tensor(positions, dtype=torch.int64, device=device)
    if pos.dim() != 1 or pos.shape[0] != len(seeds):
        raise ValueError(f"positions must be [num_rows={len(seeds)}], got {list(pos.shape)}")
    key_a, key_b = _row_keys(seed_halves(seeds, pos.device), pos, stream)
    x = torch.arange(width, dtype=torch.int64, device=pos.device).unsqueeze(0) ^ key_a  # [R, width]
    _mix32_(x)
    x ^= key_b
    return _mix32_(x)


def keyed_uniform(
    seeds: Sequence[int],
    positions: torch.Tensor | Sequence[int],  # [R]
    stream: int,
    width: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [R, width] float32 in [0, 1), multiples of 2**-24
    """Uniforms on the float32 grid of [0, 1) (as ``torch.rand``), keyed like :func:`keyed_bits`."""
    return (keyed_bits(seeds, positions, stream, width, device) >> 8).to(torch.float32).mul_(2.0**-24)


def keyed_exponential(
    seeds: Sequence[int],
    positions: torch.Tensor | Sequence[int],  # [R]
    stream: int,
    width: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [R, width] float32 >= 0
    """Exp(1) variates ``-log(1 - U)``, keyed like :func:`keyed_bits` (0 happens, with
    probability 2**-24: callers that divide by them clamp first)."""
    return keyed_uniform(seeds, positions, stream, width, device).neg_().log1p_().neg_()
