"""Speculative-decoding rejection sampling: crafted distributions (p == q, disjoint supports,
q = 0 where p > 0, one-hot p, p(x) = 0, the empty-residual fallback, k_i differing down to 0,
greedy rows), per-request keyed reproducibility, and chi-square goodness-of-fit of the
output tokens against the target's distribution (including a two-token joint under a Markov
target), with broken acceptance rules shown to fail the same test. Seeded (Gumbel-coupled)
verification: output equal to the plain keyed sampler's whatever the drafts, k or batch, its
distribution across seeds, and its acceptance below rejection sampling's.

Statistical tests use fixed seeds, so they are deterministic. Each asserts a p-value
> ALPHA = 1e-3: for a correct sampler the p-value is uniform on [0, 1], so a given choice of
seeds falsely fails one such test with probability 1e-3 (about 1 in 100 for the ~10 tests
here put together, decided once when the seeds were chosen; they pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftwise.worker.sampling.keyed_random import STREAM_SAMPLE, keyed_exponential
from draftwise.worker.sampling.sampler import Sampler, SamplingRow, processed_probs
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.rejection_sampler import RejectionOutput, accept_greedy, rejection_sample

ALPHA = 1e-3
"""Reject "the output is distributed as p" below this p-value."""

SampleFn = Callable[
    [torch.Tensor, Sequence[Sequence[int]], torch.Tensor | None, Sequence[bool], Sequence[int | None], Sequence[int]],
    RejectionOutput,
]


def gens(n: int, base: int = 0) -> list[int | None]:
    """n seeds base, base + 1, ..."""
    return [base + i for i in range(n)]


def rsample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int] | None = None,
    coupled: Sequence[bool] | None = None,
) -> RejectionOutput:
    """rejection_sample, every request at position 0 unless told (the tests' seeds differ)."""
    pos = [0] * len(draft_token_ids) if positions is None else positions
    return rejection_sample(target_probs, draft_token_ids, draft_probs, greedy, seeds, pos, coupled)


def keyed_generator(seed: int | None, position: int) -> torch.Generator:
    """The broken samplers' own randomness, also a function of (seed, position)."""
    assert seed is not None
    return torch.Generator().manual_seed(seed * 100_003 + position)


def dist(*values: float) -> torch.Tensor:  # [vocab] float32
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).float()


def fit_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (same shape, any
    dims); 0.0 if anything landed where ``probs`` is 0 (impossible under ``probs``)."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    return support_pvalue(counts, probs)


def support_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of the counts that fall where ``probs`` > 0, against ``probs``
    renormalised there (what is left of the test without the impossible-cell check)."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
    return float(chisquare(counts[keep], expected).pvalue)


def hist(tokens: Sequence[int], vocab: int) -> np.ndarray:  # [vocab]
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)


def draw(probs: torch.Tensor, gen: torch.Generator) -> list[int]:  # probs: [n, vocab]
    """One token per row of probs (the test's own sampler for drafts)."""
    return torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()


# ----------------------------------------------------------------------------- crafted


def test_p_equals_q_accepts_everything_and_draws_the_bonus_from_p() -> None:
    n, k, vocab = 3000, 4, 6
    g = torch.Generator().manual_seed(11)
    p_req = torch.rand(k + 1, vocab, generator=g).softmax(-1)  # [k + 1, vocab], the same for every request
    drafts_t = torch.stack([torch.multinomial(p_req[j], n, replacement=True, generator=g) for j in range(k)], 1)
    drafts = drafts_t.tolist()  # [n][k], x_j ~ q_j = p_j
    out = rsample(p_req.repeat(n, 1), drafts, p_req[:k].repeat(n, 1), [False] * n, gens(n))
    assert out.num_accepted == [k] * n
    assert all(t[:k] == d for t, d in zip(out.token_ids, drafts, strict=True))
    pv = fit_pvalue(hist([t[k] for t in out.token_ids], vocab), p_req[k].numpy())
    print(f"p == q bonus: p-value {pv:.3g}")
    assert pv > ALPHA


def test_disjoint_supports_always_reject_and_recover_from_p() -> None:
    n, vocab = 3000, 6
    p = dist(0.5, 0.3, 0.2, 0, 0, 0)
    q = dist(0, 0, 0, 0.2, 0.3, 0.5)
    drafts = [[x] for x in draw(q.expand(n, vocab), torch.Generator().manual_seed(3))]
    out = rsample(
        torch.stack([p, dist(1, 1, 1, 1, 1, 1)]).repeat(n, 1), drafts, q.expand(n, vocab), [False] * n, gens(n)
    )
    assert out.num_accepted == [0] * n
    assert all(len(t) == 1 and t[0] in (0, 1, 2) for t in out.token_ids)
    pv = fit_pvalue(hist([t[0] for t in out.token_ids], vocab), p.numpy())
    print(f"disjoint supports: p-value {pv:.3g}")
    assert pv > ALPHA


def test_drafted_token_with_q_zero_and_p_positive_is_always_accepted() -> None:
    # Cannot be drafted by a sampling proposer, but the ratio p/q is +inf: accept.
    n = 200
    p = dist(0.1, 0.2, 0.3, 0.4)
    q = dist(0.5, 0.5, 0, 0)
    out = rsample(p.repeat(2 * n, 1), [[2]] * n, q.expand(n, 4), [False] * n, gens(n))
    assert out.num_accepted == [1] * n


def test_q_one_hot_equals_no_draft_probs_and_is_exact() -> None:
    # q = 0 where p > 0 for every non-drafted token: what an n-gram draft means.
    n, vocab = 6000, 5
    p = dist(0.4, 0.25, 0.15, 0.2, 0)
    target = torch.stack([p, dist(1, 2, 3, 4, 5)]).repeat(n, 1)  # [2n, vocab]
    drafts = [[0]] * n
    one_hot = torch.nn.functional.one_hot(torch.zeros(n, dtype=torch.int64), vocab).float()  # [n, vocab]
    out = rsample(target, drafts, one_hot, [False] * n, gens(n))
    out_none = rsample(target, drafts, None, [False] * n, gens(n))
    assert out == out_none
    # Rejected rows never re-emit the drafted token: the residual is p without it.
    assert all(t[0] != 0 for t, a in zip(out.token_ids, out.num_accepted, strict=True) if a == 0)
    pv = fit_pvalue(hist([t[0] for t in out.token_ids], vocab), p.numpy())
    print(f"one-hot q: p-value {pv:.3g}")
    assert pv > ALPHA


def test_one_hot_p_accepts_iff_draft_matches_then_emits_it() -> None:
    vocab, target_tokens = 6, [4, 1, 3, 5]
    p = torch.nn.functional.one_hot(torch.tensor(target_tokens), vocab).float()  # [4, vocab]
    q = dist(1, 1, 1, 1, 1, 1).expand(3, vocab)
    for seed in range(50):
        out = rsample(p, [[4, 1, 0]], q, [False], [seed])
        assert out.token_ids == [[4, 1, 3]] and out.num_accepted == [2]
        out = rsample(p, [[4, 1, 3]], q, [False], [seed])
        assert out.token_ids == [[4, 1, 3, 5]] and out.num_accepted == [3]
        out = rsample(p, [[2, 1, 3]], None, [False], [seed])
        assert out.token_ids == [[4]] and out.num_accepted == [0]


def test_greedy_acceptance_from_the_targets_tokens_matches_the_one_hot_path() -> None:
    # The engine verifies an all-greedy batch from the sampler's greedy tokens (accept_greedy), without
    # building one-hot distributions: the same result as rejection_sample over those one-hots.
    rng = np.random.default_rng(3)
    vocab = 7
    drafts = [[int(t) for t in rng.integers(0, 3, size=k)] for k in (0, 1, 3, 5, 2)]
    best = [int(t) for t in rng.integers(0, 3, size=sum(len(d) + 1 for d in drafts))]
    p = torch.nn.functional.one_hot(torch.tensor(best), vocab).float()
    want = rsample(p, drafts, None, [True] * len(drafts), [None] * len(drafts))
    got = accept_greedy(best, drafts)
    assert got == want and sum(got.num_accepted) > 0 and got.num_accepted != [len(d) for d in drafts]
    assert accept_greedy([4, 1, 2], [[4, 1]]) == RejectionOutput(token_ids=[[4, 1, 2]], num_accepted=[2])
    assert accept_greedy([4, 0, 2], [[4, 1]]) == RejectionOutput(token_ids=[[4, 0]], num_accepted=[1])
    with pytest.raises(ValueError, match="greedy tokens for drafts"):
        accept_greedy([4, 1], [[4, 1]])  # the bonus position's token is missing


def test_drafted_token_with_p_zero_is_always_rejected() -> None:
    n, vocab = 500, 5
    p = dist(0.3, 0.3, 0, 0.2, 0.2)
    for q in [dist(0.1, 0.1, 0.6, 0.1, 0.1), dist(0, 0, 1, 0, 0), None]:
        draft_probs = None if q is None else q.expand(n, vocab)
        out = rsample(p.repeat(2 * n, 1), [[2]] * n, draft_probs, [False] * n, gens(n))
        assert out.num_accepted == [0] * n
        assert {t[0] for t in out.token_ids} <= {0, 1, 3, 4}


def test_empty_residual_falls_back_to_p() -> None:
    # Malformed draft: x has p(x) = q(x) = 0 and p == q elsewhere, so x is rejected and
    # max(0, p - q) has no mass. The recovered token must still come from p.
    n, vocab = 4000, 4
    p = dist(0.6, 0.4, 0, 0)
    out = rsample(p.repeat(2 * n, 1), [[3]] * n, p.expand(n, vocab), [False] * n, gens(n))
    assert out.num_accepted == [0] * n
    pv = fit_pvalue(hist([t[0] for t in out.token_ids], vocab), p.numpy())
    print(f"empty residual: p-value {pv:.3g}")
    assert pv > ALPHA


def test_k_differs_per_request_down_to_zero() -> None:
    vocab = 5
    ks = [0, 2, 0, 3, 1, 0] * 1000
    greedy = [False, False, True, True, False, False] * 1000
    n = len(ks)
    g = torch.Generator().manual_seed(5)
    p0 = dist(0.1, 0.2, 0.3, 0.4, 0)
    target = torch.cat([torch.cat([p0[None], torch.rand(k, vocab, generator=g).softmax(-1)]) for k in ks])
    draft = torch.rand(sum(ks), vocab, generator=g).softmax(-1)  # [sum(k), vocab]
    drafts, d = [], 0
    for k in ks:
        drafts.append(draw(draft[d : d + k], g) if k else [])
        d += k
    seeds = [None if gr else i for i, gr in enumerate(greedy)]
    out = rsample(target, drafts, draft, greedy, seeds)
    for t, a, k, dr in zip(out.token_ids, out.num_accepted, ks, drafts, strict=True):
        assert 0 <= a <= k and len(t) == a + 1 and t[:a] == dr[:a]
    zero_k = [i for i in range(n) if ks[i] == 0]
    assert all(out.token_ids[i] == [3] for i in zero_k if greedy[i])  # argmax p
    sampled = [out.token_ids[i][0] for i in zero_k if not greedy[i]]
    pv = fit_pvalue(hist(sampled, vocab), p0.numpy())
    print(f"k = 0 rows: p-value {pv:.3g}")
    assert pv > ALPHA


def test_k_zero_draws_what_the_plain_sampler_draws() -> None:
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(2))  # [8, 40]
    params = [
        SamplingParams(temperature=0.7, top_k=10, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.8, seed=2),
        SamplingParams(min_p=0.05, seed=3),
    ] * 2

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(p, None if p.is_greedy else p.seed, prompt_token_ids=[], output_token_ids=[]) for p in params
        ]

    expected = Sampler()(logits, rows()).token_ids
    rs = rows()
    out = rsample(processed_probs(logits, rs), [[]] * 8, None, [r.params.is_greedy for r in rs], [r.seed for r in rs])
    assert [t[0] for t in out.token_ids] == expected and out.num_accepted == [0] * 8


def test_empty_batch() -> None:
    assert rsample(torch.zeros(0, 7), [], None, [], []) == RejectionOutput(token_ids=[], num_accepted=[])


# ----------------------------------------------------------------------------- greedy


def test_greedy_accepts_while_argmax_matches_then_emits_argmax() -> None:
    g = torch.Generator().manual_seed(4)
    p = torch.rand(4, 9, generator=g).softmax(-1)  # [4, 9]: soft p, the rule uses its argmax
    best = p.argmax(-1).tolist()
    q = torch.rand(3, 9, generator=g).softmax(-1)
    wrong = (best[2] + 1) % 9
    for draft_probs in (q, None):
        out = rsample(
            p.repeat(3, 1),
            [best[:3], [best[0], best[1], wrong], [wrong, 0, 0]],
            draft_probs.repeat(3, 1) if draft_probs is not None else None,
            [True] * 3,
            [None] * 3,
        )
        assert out.token_ids == [best, best[:3], [best[0]]]
        assert out.num_accepted == [3, 2, 0]


def test_all_greedy_fast_path_matches_the_general_path() -> None:
    """An all-greedy batch takes a shortcut; its rows must come out as they do next to a
    sampling row (which sends the batch down the general, vectorised path)."""
    g = torch.Generator().manual_seed(21)
    ks = [0, 3, 1, 5, 2]
    vocab = 7
    p = torch.rand(sum(ks) + len(ks), vocab, generator=g).softmax(-1)
    best = p.argmax(-1).tolist()
    drafts, row = [], 0
    for k in ks:  # drafts that follow the argmax for a while, then may stray
        d = [
            best[row + j] if torch.rand(1, generator=g).item() < 0.7 else (best[row + j] + 1) % vocab for j in range(k)
        ]
        drafts.append(d)
        row += k + 1
    fast = rsample(p, drafts, None, [True] * len(ks), [None] * len(ks))
    extra_p = torch.cat([p, dist(1, 2, 3, 4, 5, 6, 7).repeat(3, 1)])
    mixed = rsample(extra_p, [*drafts, [0, 1]], None, [True] * len(ks) + [False], [None] * len(ks) + [0])
    assert fast.token_ids == mixed.token_ids[:-1]
    assert fast.num_accepted == mixed.num_accepted[:-1]
    assert any(0 < a < k for a, k in zip(fast.num_accepted, ks, strict=True))


def test_greedy_rows_ignore_the_seed() -> None:
    p = dist(0.1, 0.5, 0.2, 0.2).repeat(3, 1)  # [3, 4]
    for seed in (None, 9, 10):
        for coupled in (False, True):
            out = rsample(p, [[1, 2]], None, [True], [seed], [5], [coupled])
            assert out.token_ids == [[1, 1]] and out.num_accepted == [1]


# ----------------------------------------------------------------------------- seeded


def test_seeded_request_is_reproducible_whatever_the_batch() -> None:
    vocab = 7
    g = torch.Generator().manual_seed(8)
    # Near-equal p and q: acceptance is genuinely random, so a shifted RNG would show.
    mine_p = torch.rand(4, vocab, generator=g).softmax(-1)  # [k + 1, vocab], k = 3
    mine_q = (mine_p[:3] + 0.3 * torch.rand(3, vocab, generator=g)).softmax(-1)
    mine_d = [2, 5, 1]

    def run_alone(seed: int) -> tuple[list[int], int]:
        out = rsample(mine_p, [mine_d], mine_q, [False], [seed], [7])
        return out.token_ids[0], out.num_accepted[0]

    def run_in_batch(seed: int, before: int, after: int) -> tuple[list[int], int]:
        ks = [(i % 4) for i in range(before)] + [3] + [(i % 6) for i in range(after)]  # max k 3 or 5
        me = before
        target = torch.cat(
            [mine_p if i == me else torch.rand(k + 1, vocab, generator=g).softmax(-1) for i, k in enumerate(ks)]
        )
        draft = torch.cat(
            [mine_q if i == me else torch.rand(k, vocab, generator=g).softmax(-1) for i, k in enumerate(ks)]
        )
        drafts = [
            mine_d if i == me else [int(x) for x in torch.randint(vocab, (k,), generator=g)] for i, k in enumerate(ks)
        ]
        greedy = [i != me and i % 2 == 0 for i in range(len(ks))]
        seeds = [seed if i == me else (None if greedy[i] else 1000 + i) for i in range(len(ks))]
        positions = [7 if i == me else 3 * i for i in range(len(ks))]
        out = rsample(target, drafts, draft, greedy, seeds, positions)
        return out.token_ids[me], out.num_accepted[me]

    outcomes = set()
    for seed in range(40):
        tokens, acc = run_alone(seed)
        outcomes.add((tuple(tokens), acc))
        for before, after in [(0, 5), (3, 0), (6, 9)]:
            assert run_in_batch(seed, before, after) == (tokens, acc)
    assert len(outcomes) > 5  # the seeds matter: this is not a deterministic case


# ----------------------------------------------------------------------------- validation


def test_invalid_inputs_are_rejected() -> None:
    p = dist(0.5, 0.5).repeat(2, 1)  # [2, 2]
    with pytest.raises(ValueError, match="target_probs"):
        rsample(p, [[0, 1]], None, [False], gens(1))
    with pytest.raises(ValueError, match="draft_probs"):
        rsample(p, [[0]], p, [False], gens(1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rsample(p, [[2]], None, [False], gens(1))
    with pytest.raises(ValueError, match="no seed"):
        rsample(p, [[0]], None, [False], [None])
    with pytest.raises(ValueError, match="one entry per request"):
        rsample(p, [[0]], None, [False, True], gens(1))
    with pytest.raises(ValueError, match="one entry per request"):
        rejection_sample(p, [[0]], None, [False], gens(1), [0, 1])
    with pytest.raises(ValueError, match="one entry per request"):
        rejection_sample(p, [[0]], None, [False], gens(1), [0], [True, False])
    with pytest.raises(ValueError, match="position"):
        rejection_sample(p, [[0]], None, [False], gens(1), [-1])
    with pytest.raises(ValueError, match="position"):
        rejection_sample(p, [[0]], None, [False], gens(1), [2**31])


# ----------------------------------------------------------------------------- exactness

# k = 1, one position: p and q exercise every edge at once: q > p, q < p, q = 0 < p (token 2,
# never drafted, reachable only through the residual), p = 0 < q (token 5, always rejected).
P1 = dist(0.30, 0.25, 0.20, 0.15, 0.10, 0.0)
Q1 = dist(0.05, 0.10, 0.0, 0.35, 0.20, 0.30)
BONUS1 = dist(0.1, 0.1, 0.2, 0.2, 0.4, 0.0)


def always_accept(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int],
) -> RejectionOutput:
    """Broken: keep every draft token, then a bonus from p."""
    out, row = [], 0
    for ids, seed, pos in zip(draft_token_ids, seeds, positions, strict=True):
        row += len(ids)
        gen = keyed_generator(seed, pos)
        out.append([*ids, int(torch.multinomial(target_probs[row], 1, generator=gen))])
        row += 1
    return RejectionOutput(token_ids=out, num_accepted=[len(d) for d in draft_token_ids])


def resample_from_p(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int],
) -> RejectionOutput:
    """Broken: the right acceptance test, but on rejection draw from p instead of max(0, p - q)."""
    assert draft_probs is not None
    out, nacc, row, drow = [], [], 0, 0
    for ids, seed, pos in zip(draft_token_ids, seeds, positions, strict=True):
        gen = keyed_generator(seed, pos)
        toks: list[int] = []
        for j, x in enumerate(ids):
            ratio = float(target_probs[row + j, x] / draft_probs[drow + j, x])
            if float(torch.rand((), generator=gen)) >= ratio:
                break
            toks.append(x)
        a = len(toks)
        toks.append(int(torch.multinomial(target_probs[row + a], 1, generator=gen)))
        out.append(toks)
        nacc.append(a)
        row, drow = row + len(ids) + 1, drow + len(ids)
    return RejectionOutput(token_ids=out, num_accepted=nacc)


def one_position_run(sample: SampleFn, n: int = 20000) -> RejectionOutput:
    """n requests with k = 1 under (P1, Q1), each with its own seeded generator."""
    drafts = [[x] for x in draw(Q1.expand(n, 6), torch.Generator().manual_seed(2024))]
    target = torch.stack([P1, BONUS1]).repeat(n, 1)  # [2n, vocab]
    return sample(target, drafts, Q1.expand(n, 6).contiguous(), [False] * n, gens(n, base=10_000), [0] * n)


def test_one_position_output_is_distributed_as_p() -> None:
    out = one_position_run(rejection_sample)
    pv = fit_pvalue(hist([t[0] for t in out.token_ids], 6), P1.numpy())
    # Given acceptance, the second token is the bonus, from the bonus position's p.
    pv_bonus = fit_pvalue(hist([t[1] for t in out.token_ids if len(t) == 2], 6), BONUS1.numpy())
    rate = sum(out.num_accepted) / len(out.num_accepted)
    expected_rate = float(torch.minimum(P1, Q1).sum())  # sum_x min(p, q) = 0.40
    print(f"k=1: first token p-value {pv:.3g}, bonus p-value {pv_bonus:.3g}, acceptance {rate:.4f}")
    assert pv > ALPHA and pv_bonus > ALPHA
    assert abs(rate - expected_rate) < 4 * (expected_rate * (1 - expected_rate) / len(out.num_accepted)) ** 0.5


@pytest.mark.parametrize("broken", [always_accept, resample_from_p])
def test_the_distribution_test_catches_a_wrong_rule(broken: SampleFn) -> None:
    out = one_position_run(broken)
    counts = hist([t[0] for t in out.token_ids], 6)
    pv, pv_support = fit_pvalue(counts, P1.numpy()), support_pvalue(counts, P1.numpy())
    print(f"{broken.__name__}: p-value {pv:.3g} (on p's support alone {pv_support:.3g})")
    assert pv < ALPHA and pv_support < ALPHA


def test_ngram_style_draft_output_is_distributed_as_p() -> None:
    # draft_probs=None with the same deterministic draft in every row (as prompt lookup would).
    n = 20000
    target = torch.stack([P1, BONUS1]).repeat(n, 1)
    out = rsample(target, [[1]] * n, None, [False] * n, gens(n, base=50_000))
    pv = fit_pvalue(hist([t[0] for t in out.token_ids], 6), P1.numpy())
    print(f"n-gram draft: p-value {pv:.3g}")
    assert pv > ALPHA


# Markov target and draft over 5 tokens: next-token distributions depend on the previous
# token. Rows cover p == q (3), one-hot q (4), q = 0 < p and p = 0 < q.
T = np.array(
    [
        [0.40, 0.30, 0.20, 0.10, 0.00],
        [0.10, 0.15, 0.25, 0.20, 0.30],
        [0.00, 0.50, 0.10, 0.25, 0.15],
        [0.30, 0.00, 0.30, 0.20, 0.20],
        [0.25, 0.25, 0.25, 0.00, 0.25],
    ]
)
Q = np.array(
    [
        [0.10, 0.10, 0.30, 0.20, 0.30],
        [0.30, 0.30, 0.00, 0.20, 0.20],
        [0.20, 0.30, 0.10, 0.40, 0.00],
        [0.30, 0.00, 0.30, 0.20, 0.20],
        [0.00, 0.00, 1.00, 0.00, 0.00],
    ]
)


def markov_step(
    sample: SampleFn, context: list[int], seeds: list[int | None], position: int, k: int, g: torch.Generator
) -> RejectionOutput:
    """One speculative step for each request: draft k tokens from Q's chain after its last
    context token, score them under T, verify."""
    t_mat, q_mat = torch.tensor(T, dtype=torch.float32), torch.tensor(Q, dtype=torch.float32)
    n = len(context)
    chain = [torch.tensor(context, dtype=torch.int64)]  # [n] each: context, x_1, ..., x_k
    for _ in range(k):
        chain.append(torch.multinomial(q_mat[chain[-1]], 1, generator=g)[:, 0])
    seq = torch.stack(chain, 1)  # [n, k + 1]
    target = t_mat[seq].reshape(n * (k + 1), len(T))  # [n (k + 1), vocab]: p after context, x_1, ..., x_k
    draft = q_mat[seq[:, :k]].reshape(n * k, len(T))  # [n k, vocab]: q that drew x_1, ..., x_k
    return sample(target, seq[:, 1:].tolist(), draft, [False] * n, seeds, [position] * n)


def two_token_counts(sample: SampleFn, n: int = 20000, k: int = 3) -> np.ndarray:  # [vocab, vocab]
    """Counts of the first two generated tokens after context token 0, running a second
    step for requests whose first step produced only one token."""
    g = torch.Generator().manual_seed(77)
    seeds = gens(n, base=90_000)
    first = markov_step(sample, [0] * n, seeds, 5, k, g).token_ids
    short = [i for i in range(n) if len(first[i]) < 2]
    second = markov_step(sample, [first[i][0] for i in short], [seeds[i] for i in short], 6, k, g).token_ids
    if sample is rejection_sample:
        assert short, "the first step must reject somewhere for this test to mean anything"
    for i, t in zip(short, second, strict=True):
        first[i] = [first[i][0], t[0]]
    counts = np.zeros((5, 5), dtype=np.int64)
    for t in first:
        counts[t[0], t[1]] += 1
    return counts


def test_markov_two_token_joint_is_distributed_as_the_target() -> None:
    counts = two_token_counts(rejection_sample)
    joint = T[0][:, None] * T  # P(y1, y2) = T[0, y1] T[y1, y2]
    pv_joint = fit_pvalue(counts, joint)
    pv_first = fit_pvalue(counts.sum(1), T[0])
    pv_second = fit_pvalue(counts.sum(0), T[0] @ T)
    print(f"k=3 Markov: joint p-value {pv_joint:.3g}, first {pv_first:.3g}, second {pv_second:.3g}")
    assert min(pv_joint, pv_first, pv_second) > ALPHA


@pytest.mark.parametrize("broken", [always_accept, resample_from_p])
def test_the_joint_test_catches_a_wrong_rule(broken: SampleFn) -> None:
    counts, joint = two_token_counts(broken, n=5000), T[0][:, None] * T
    pv, pv_support = fit_pvalue(counts, joint), support_pvalue(counts, joint)
    print(f"k=3 Markov {broken.__name__}: p-value {pv:.3g} (on the support alone {pv_support:.3g})")
    assert pv < ALPHA and pv_support < ALPHA


# ----------------------------------------------------------------------------- coupled (seeded)


def keyed_choice(p: torch.Tensor, seed: int, positions: Sequence[int]) -> list[int]:  # p: [n, vocab]
    """The plain sampler's keyed race at each position: argmax(p / E(seed, t))."""
    e = keyed_exponential([seed] * len(positions), list(positions), STREAM_SAMPLE, p.shape[1])
    return (p / e.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1).tolist()


def test_coupled_output_is_the_plain_keyed_output_whatever_the_drafts_k_and_batch() -> None:
    g = torch.Generator().manual_seed(31)
    vocab, base = 9, 40
    mine_p = (2 * torch.rand(6, vocab, generator=g)).softmax(-1)  # [6, vocab]: p at positions 40..45
    plain = keyed_choice(mine_p, 77, range(base, base + 6))
    assert len(set(plain)) > 1
    seen = set()
    for k in range(6):
        for trial in range(4):
            # trial 0: all accepted, the bonus is the plain token after them; then random drafts
            drafts = plain[:k] if trial == 0 else [int(x) for x in torch.randint(vocab, (k,), generator=g)]
            acc = 0
            while acc < k and drafts[acc] == plain[acc]:
                acc += 1
            ks = [2, k, 0, 3]  # neighbours: a greedy row, an unseeded row, another seeded row
            target = torch.cat([torch.rand(kk + 1, vocab, generator=g).softmax(-1) for kk in ks])
            start = ks[0] + 1
            target[start : start + k + 1] = mine_p[: k + 1]
            others = [[int(x) for x in torch.randint(vocab, (kk,), generator=g)] for kk in ks]
            others[1] = drafts
            q = torch.rand(sum(ks), vocab, generator=g).softmax(-1) if trial % 2 else None
            out = rejection_sample(
                target, others, q, [True, False, False, False], [None, 77, 5, 6], [3, base, 9, 12],
                [False, True, False, True],
            )  # fmt: skip
            assert out.num_accepted[1] == acc and out.token_ids[1] == plain[: acc + 1], (k, trial)
            seen.add(acc)
    assert len(seen) >= 3


def test_coupled_rows_need_no_draft_distribution_and_match_the_sampler() -> None:
    """A seeded row with k = 0 is exactly the Sampler's draw; with n-gram style drafts (q None)
    the same rule applies."""
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, seed=12)
    for prompt_len in (0, 4, 9):
        srow = SamplingRow(params, 12, prompt_token_ids=[1] * prompt_len, output_token_ids=[])
        want = Sampler()(logits, [srow]).token_ids[0]
        p = processed_probs(logits, [srow])
        out = rejection_sample(p, [[]], None, [False], [12], [prompt_len], [True])
        assert out.token_ids == [[want]]
        out = rejection_sample(p.repeat(2, 1), [[want]], None, [False], [12], [prompt_len], [True])
        assert out.num_accepted == [1]


def coupled_markov_counts(n: int, k: int = 3) -> tuple[np.ndarray, float]:
    """Two tokens after context 0 under T, drafted from Q with the same keyed noise (the
    draft's keyed race), verified coupled; a second step where the first gave one token.
    Returns the counts and the acceptance rate of the first step."""
    t_mat, q_mat = torch.tensor(T, dtype=torch.float32), torch.tensor(Q, dtype=torch.float32)
    seeds = list(range(200_000, 200_000 + n))

    def step(context: list[int], seeds: list[int], pos: int) -> RejectionOutput:
        m = len(context)
        chain = [torch.tensor(context)]
        for j in range(k):  # the draft proposes argmax(q / E(seed, pos + j))
            e = keyed_exponential(seeds, [pos + j] * m, STREAM_SAMPLE, 5).clamp_min(1e-38)
            chain.append((q_mat[chain[-1]] / e).argmax(-1))
        seq = torch.stack(chain, 1)  # [m, k + 1]
        target = t_mat[seq].reshape(m * (k + 1), 5)
        return rejection_sample(target, seq[:, 1:].tolist(), None, [False] * m, seeds, [pos] * m, [True] * m)

    first = step([0] * n, seeds, 5)
    rate = sum(first.num_accepted) / (k * n)
    toks = first.token_ids
    short = [i for i in range(n) if len(toks[i]) < 2]
    second = step([toks[i][0] for i in short], [seeds[i] for i in short], 6)
    for i, t in zip(short, second.token_ids, strict=True):
        toks[i] = [toks[i][0], t[0]]
    counts = np.zeros((5, 5), dtype=np.int64)
    for t in toks:
        counts[t[0], t[1]] += 1
    return counts, rate


def test_coupled_markov_joint_is_distributed_as_the_target_across_seeds() -> None:
    counts, _ = coupled_markov_counts(20000)
    joint = T[0][:, None] * T
    pv = fit_pvalue(counts, joint)
    print(f"coupled k=3 Markov: joint p-value {pv:.3g}")
    assert pv > ALPHA


def test_coupled_acceptance_is_below_rejection_sampling() -> None:
    """No coupling of x ~ q and y ~ p agrees more often than sum min(p, q) (rejection
    sampling's rate); the Gumbel coupling is below it for (P1, Q1)."""
    n = 20000
    seeds = list(range(300_000, 300_000 + n))
    e = keyed_exponential(seeds, [0] * n, STREAM_SAMPLE, 6).clamp_min(1e-38)
    drafts = [[int(x)] for x in (Q1 / e).argmax(-1)]
    target = torch.stack([P1, BONUS1]).repeat(n, 1)
    out = rejection_sample(target, drafts, None, [False] * n, seeds, [0] * n, [True] * n)
    coupled = sum(out.num_accepted) / n
    rejection = sum(one_position_run(rejection_sample).num_accepted) / n
    bound = float(torch.minimum(P1, Q1).sum())
    print(f"acceptance: coupled {coupled:.4f}, rejection sampling {rejection:.4f}, bound {bound:.4f}")
    assert coupled < rejection and coupled < bound
    pv = fit_pvalue(hist([t[0] for t in out.token_ids], 6), P1.numpy())
    assert pv > ALPHA
