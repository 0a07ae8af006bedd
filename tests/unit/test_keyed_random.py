"""Keyed randomness (worker/sampling/keyed_random.py): a pure function of (seed, position, stream,
entry), equal to an independent pure-Python implementation of the construction, pinned
values (a worker of another version or device must draw the same numbers), and the
statistics the samplers rely on: uniform bits, Exp(1) variates, no correlation between
neighbouring entries, positions or seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from draftwise.worker.sampling.keyed_random import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    keyed_bits,
    keyed_exponential,
    keyed_uniform,
)

M32 = 0xFFFFFFFF


def py_mix(x: int) -> int:
    """lowbias32 in plain Python integers (unsigned 32-bit arithmetic)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_bits(seed: int, position: int, stream: int, entry: int) -> int:
    """The documented construction, independently: two key chains, then two rounds per entry."""
    s = seed & ((1 << 64) - 1)
    keys = []
    for lane in (0x9E3779B9, 0x243F6A88):
        h = lane ^ stream
        for word in (s & M32, s >> 32, position):
            h = py_mix(h ^ word)
        keys.append(h)
    return py_mix(py_mix(entry ^ keys[0]) ^ keys[1])


def test_matches_a_pure_python_implementation() -> None:
    g = torch.Generator().manual_seed(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1] + torch.randint(0, 2**62, (10,), generator=g).tolist()
    positions = [0, 1, 2**31 - 1, 5, 17, 2047] + torch.randint(0, 4096, (10,), generator=g).tolist()
    for stream in (STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT):
        got = keyed_bits(seeds, positions, stream, 40).tolist()
        for r, (s, p) in enumerate(zip(seeds, positions, strict=True)):
            assert got[r] == [py_bits(s, p, stream, i) for i in range(40)], (s, p, stream)


def test_pinned_values() -> None:
    """Changing these changes every seeded output: a failover between workers of two versions
    would no longer continue exactly. Change them only on purpose, and say so in the docs."""
    got = keyed_bits([0, 2**64 - 1, 12345], [0, 7, 2**31 - 1], STREAM_SAMPLE, 3).tolist()
    assert got == [
        [3059327793, 1431440581, 1783924842],
        [1499634526, 2129446392, 3028957282],
        [1321807226, 3964135572, 1842712720],
    ]
    assert keyed_bits([-1], [7], STREAM_SAMPLE, 3).tolist() == [got[1]]  # seeds modulo 2**64


def test_a_row_depends_only_on_its_own_key_not_on_the_batch_or_width() -> None:
    alone = keyed_exponential([42], [9], STREAM_SAMPLE, 100)  # [1, 100]
    batch = keyed_exponential([7, 42, 42, 8], [9, 9, 10, 9], STREAM_SAMPLE, 300)  # [4, 300]
    assert torch.equal(batch[1, :100], alone[0])
    assert not torch.equal(batch[0, :100], alone[0])  # another seed
    assert not torch.equal(batch[2, :100], alone[0])  # another position
    assert not torch.equal(keyed_exponential([42], [9], STREAM_DRAFT, 100), alone)  # another stream
    pos_t = torch.tensor([9])
    assert torch.equal(keyed_exponential([42], pos_t, STREAM_SAMPLE, 100), alone)  # positions as a tensor


def test_uniform_and_exponential_distributions() -> None:
    seeds = list(range(64))
    positions = [3 * s for s in seeds]
    u = keyed_uniform(seeds, positions, STREAM_ACCEPT, 4096)  # [64, 4096]
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = np.histogram(u.numpy().ravel(), bins=256, range=(0, 1))[0]
    assert chisquare(counts).pvalue > 1e-3
    bits = keyed_bits(seeds, positions, STREAM_ACCEPT, 4096)
    for b in (0, 7, 8, 15, 31):  # every bit, low ones included, is fair
        assert abs(float(((bits >> b) & 1).double().mean()) - 0.5) < 0.005, b
    e = keyed_exponential(seeds, positions, STREAM_SAMPLE, 4096).double().numpy().ravel()
    assert kstest(e, "expon").pvalue > 1e-3
    assert abs(e.mean() - 1) < 0.01


def test_no_correlation_between_neighbours() -> None:
    """Entries i and i + 1, positions t and t + 1, seeds s and s + 1, and streams of one key."""
    n = 200
    a = keyed_uniform(list(range(n)), list(range(n)), STREAM_SAMPLE, 2048).double()  # [n, 2048]
    neighbours = [
        (a[:, :-1], a[:, 1:]),  # entries
        (a, keyed_uniform(list(range(n)), list(range(1, n + 1)), STREAM_SAMPLE, 2048).double()),  # positions
        (a, keyed_uniform(list(range(1, n + 1)), list(range(n)), STREAM_SAMPLE, 2048).double()),  # seeds
        (a, keyed_uniform(list(range(n)), list(range(n)), STREAM_DRAFT, 2048).double()),  # streams
    ]
    for x, y in neighbours:
        r = np.corrcoef(x.numpy().ravel(), y.numpy().ravel())[0, 1]
        assert abs(r) < 0.01, r  # n * 2048 = 409,600 pairs: the standard error is 0.0016
        assert not torch.equal(x, y)


def test_bad_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="positions must be in"):
        keyed_bits([1], [-1], STREAM_SAMPLE, 4)
    with pytest.raises(ValueError, match="positions must be in"):
        keyed_bits([1], [2**32], STREAM_SAMPLE, 4)
    with pytest.raises(ValueError, match="num_rows=2"):
        keyed_bits([1, 2], [3], STREAM_SAMPLE, 4)
