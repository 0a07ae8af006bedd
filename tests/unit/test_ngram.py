"""N-gram prompt-lookup proposer: longest suffix first, most recent earlier occurrence,
truncation at k and at the sequence end, min/max bounds, validation, and a brute-force
reference on random sequences."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from draftwise.worker.speculative.ngram import NgramProposer


def reference(tokens: Sequence[int], k: int, lo: int, hi: int) -> list[int]:
    """Brute force, straight from the definition."""
    toks = list(tokens)
    n = len(toks)
    if k == 0:
        return []
    for size in range(hi, lo - 1, -1):
        if size >= n:
            continue
        suffix = toks[n - size :]
        for start in range(n - size - 1, -1, -1):  # strictly earlier than the suffix, most recent first
            if toks[start : start + size] == suffix:
                return toks[start + size : start + size + k]
    return []


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    toks = [7, 8, 9, 1, 2, 5, 9, 6, 8, 9]
    # suffix [8, 9] occurs at 1; [9] alone occurs more recently at 6 (followed by 6).
    assert NgramProposer(1, 4).lookup(toks, 2) == [1, 2]
    assert NgramProposer(1, 1).lookup(toks, 2) == [6, 8]


def test_most_recent_occurrence_is_used() -> None:
    toks = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert NgramProposer(1, 4).lookup(toks, 2) == [20, 21]
    assert NgramProposer(2, 2).lookup(toks, 3) == [20, 21, 1]


def test_k_truncates_and_the_sequence_end_truncates() -> None:
    toks = [3, 4, 5, 6, 7, 3, 4]
    p = NgramProposer(1, 3)
    assert p.lookup(toks, 1) == [5]
    assert p.lookup(toks, 3) == [5, 6, 7]
    assert p.lookup(toks, 10) == [5, 6, 7, 3, 4]  # everything up to the end
    # An overlapping most-recent occurrence leaves little to propose.
    assert p.lookup([1, 1, 1, 1], 3) == [1]


def test_no_match_or_k_zero_proposes_nothing() -> None:
    p = NgramProposer(1, 4)
    assert p.lookup([1, 2, 3, 4], 5) == []
    assert p.lookup([1, 2, 1, 2], 0) == []
    assert p.lookup([], 3) == []
    assert p.lookup([5], 3) == []


def test_the_suffix_itself_is_not_an_occurrence() -> None:
    # The only place [2, 3] occurs is the suffix: no earlier occurrence, nothing to propose;
    # with min 1, [3] has no earlier occurrence either.
    assert NgramProposer(1, 2).lookup([1, 2, 3], 4) == []
    assert NgramProposer(2, 2).lookup([3, 2, 3], 4) == []
    assert NgramProposer(1, 2).lookup([3, 2, 3], 4) == [2, 3]


def test_min_and_max_bound_the_suffix_length() -> None:
    toks = [1, 2, 3, 4, 9, 2, 3, 4, 8, 3, 4]
    # The 3-token suffix [8, 3, 4] never occurred before; [3, 4] did, most recently at 6.
    assert NgramProposer(1, 4).lookup(toks, 2) == [8, 3]
    assert NgramProposer(3, 4).lookup(toks, 2) == []  # no 3- or 4-token suffix occurred earlier
    toks = [5, 1, 2, 3, 6, 9, 2, 3, 7, 1, 2, 3]
    assert NgramProposer(1, 3).lookup(toks, 1) == [6]  # [1, 2, 3] at 1
    assert NgramProposer(1, 2).lookup(toks, 1) == [7]  # capped at [2, 3]: most recent at 6
    assert NgramProposer(4, 5).lookup(toks, 1) == []


def test_matches_the_brute_force_reference_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(400):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        toks = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        k = rng.randint(0, 6)
        assert NgramProposer(lo, hi).lookup(toks, k) == reference(toks, k, lo, hi), (toks, k, lo, hi)


def test_accepts_any_int_sequence() -> None:
    assert NgramProposer().lookup((4, 5, 6, 4, 5), 2) == [6, 4]


@pytest.mark.parametrize(
    ("lo", "hi", "field"),
    [
        (0, 4, "prompt_lookup_min"),
        (-1, 4, "prompt_lookup_min"),
        (True, 4, "prompt_lookup_min"),
        (1.0, 4, "prompt_lookup_min"),
        (3, 2, "prompt_lookup_max"),
        (1, 0, "prompt_lookup_max"),
        (1, "4", "prompt_lookup_max"),
    ],
)
def test_bad_ranges_name_the_field(lo: object, hi: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(lo, hi)  # type: ignore[arg-type]


def test_negative_k_is_rejected() -> None:
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer().lookup([1, 2, 1], -1)
