"""The sampler: greedy, penalties, min_tokens, top-k/top-p/min-p token sets, per-row seeded
determinism whatever the batch, logprobs, and chi-square goodness-of-fit of the sampled
distributions against an independent float64 reference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftwise.worker.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    processed_probs,
)
from draftwise.worker.sampling.sampling_params import SamplingParams


def row(
    params: SamplingParams | None = None,
    *,
    seed: int | None = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
    **kw: Any,
) -> SamplingRow:
    """A row with its own seed (None for greedy rows)."""
    p = params if params is not None else SamplingParams(**kw)
    return SamplingRow(
        params=p,
        seed=None if p.is_greedy else seed,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=eos,
    )


def support(probs: torch.Tensor) -> set[int]:  # probs: [vocab]
    return {int(i) for i in torch.nonzero(probs > 0).flatten()}


# ----------------------------------------------------------------------------- greedy


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))  # [6, 50]
    rows = [row(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5) for _ in range(6)]
    assert all(r.seed is None for r in rows)
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    probs = processed_probs(logits, rows)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(dim=-1), 50).float())


def test_greedy_and_sampled_rows_mix() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))  # [4, 30]
    rows = [row(temperature=0.0), row(temperature=1.0, seed=3), row(temperature=9e-6), row(temperature=0.5, seed=4)]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(logits[2].argmax())


def test_greedy_argmax_is_taken_after_penalties() -> None:
    logits = torch.tensor([[3.0, 2.5, 1.0]])  # [1, 3]
    assert Sampler()(logits, [row(temperature=0.0, output=[0], presence_penalty=1.0)]).token_ids == [1]


# -------------------------------------------------------------------------- penalties

RAW = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0]


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([RAW])  # [1, 7]
    out = apply_penalties(logits, [row(prompt=[0, 1], output=[2, 3, 3, 6], repetition_penalty=2.0)])
    # positive seen logits halved, negative doubled; 0.0 stays 0; unseen tokens 4, 5 untouched
    assert out[0].tolist() == [1.0, -4.0, 0.5, -2.0, 0.5, 3.0, 0.0]


def test_repetition_penalty_below_one_boosts() -> None:
    logits = torch.tensor([RAW])  # [1, 7]
    out = apply_penalties(logits, [row(prompt=[0], output=[1], repetition_penalty=0.5)])
    assert out[0].tolist() == [4.0, -1.0, 1.0, -1.0, 0.5, 3.0, 0.0]


def test_presence_and_frequency_count_output_tokens_only() -> None:
    logits = torch.tensor([RAW])  # [1, 7]
    r = row(prompt=[0, 1, 4, 4], output=[2, 3, 3, 3, 5], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [r])
    # token 2: once -> -0.5 - 0.25; token 3: three times -> -0.5 - 0.75; token 5: once; prompt-only 0, 1, 4 untouched
    assert out[0].tolist() == [2.0, -2.0, 0.25, -2.25, 0.5, 2.25, 0.0]


def test_negative_presence_and_frequency_encourage() -> None:
    logits = torch.tensor([RAW])  # [1, 7]
    out = apply_penalties(logits, [row(output=[4, 4], presence_penalty=-1.0, frequency_penalty=-0.5)])
    assert out[0].tolist() == [2.0, -2.0, 1.0, -1.0, 2.5, 3.0, 0.0]


def test_all_penalties_together_repetition_first() -> None:
    logits = torch.tensor([RAW, RAW, RAW])  # [3, 7]
    rows = [
        row(),  # default penalties: left exactly as is
        row(prompt=[0, 1], output=[2, 3, 3], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        row(temperature=0.0, prompt=[5], output=[5, 5], repetition_penalty=1.5),
    ]
    before = logits.clone()
    out = apply_penalties(logits, rows)
    assert torch.equal(logits, before), "the input must not be modified"
    assert out[0].tolist() == RAW
    assert out[1].tolist() == [1.0, -4.0, 0.5 - 0.75, -2.0 - 1.0, 0.5, 3.0, 0.0]
    assert out[2].tolist() == [2.0, -2.0, 1.0, -1.0, 0.5, 2.0, 0.0]


def test_no_penalties_returns_the_logits_untouched() -> None:
    logits = torch.tensor([RAW])  # [1, 7]
    assert apply_penalties(logits, [row(output=[1, 2])]) is logits


def test_penalties_reject_token_ids_outside_the_vocabulary() -> None:
    logits = torch.tensor([RAW])  # [1, 7]
    with pytest.raises(ValueError, match="token ids must be in"):
        apply_penalties(logits, [row(output=[7], presence_penalty=1.0)])
    with pytest.raises(ValueError, match="token ids must be in"):
        apply_penalties(logits, [row(prompt=[-1], repetition_penalty=1.5)])


# -------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    # eos (5) is the argmax, stop id 3 the second; 1 the third.
    logits = torch.tensor([[0.0, 2.0, 0.5, 3.0, 1.0, 4.0]])  # [1, 6]
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    sampled = SamplingParams(min_tokens=3, stop_token_ids=[3])
    for n_out in range(5):
        greedy = row(params, output=[0] * n_out, eos=[5])
        other = row(sampled, output=[0] * n_out, eos=[5])
        masked = apply_min_tokens(logits, [greedy])[0]
        token = Sampler()(logits, [greedy]).token_ids[0]
        probs = processed_probs(logits, [other])[0]
        if n_out < 3:
            assert math.isinf(masked[5]) and math.isinf(masked[3]) and masked[1] == 2.0
            assert token == 1
            assert probs[3] == 0 and probs[5] == 0 and probs[1] > 0
        else:
            assert torch.equal(masked, logits[0])
            assert token == 5
            assert support(probs) == set(range(6))


def test_min_tokens_with_ignore_eos_masks_only_stop_ids() -> None:
    logits = torch.tensor([[0.0, 2.0, 0.5, 3.0, 1.0, 4.0]])  # [1, 6]
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    masked = apply_min_tokens(logits, [row(p, eos=[5])])[0]
    assert math.isinf(masked[3]) and masked[5] == 4.0


def test_min_tokens_ignores_stop_ids_outside_vocab_and_leaves_input_alone() -> None:
    logits = torch.tensor([[0.0, 2.0, 0.5]])  # [1, 3]
    before = logits.clone()
    masked = apply_min_tokens(logits, [row(min_tokens=2, stop_token_ids=[1, 99], eos=[7])])
    assert masked[0].tolist() == [0.0, -math.inf, 0.5]
    assert torch.equal(logits, before)


# ------------------------------------------------------------------ top-k / top-p / min-p

# Five tokens with probabilities 0.4 (id 2), 0.3 (id 4), 0.15 (id 0), 0.1 (id 1), 0.05 (id 3).
P5 = torch.tensor([0.15, 0.1, 0.4, 0.05, 0.3], dtype=torch.float64)
L5 = P5.log().float().unsqueeze(0)  # [1, 5]


def kept(**kw: Any) -> set[int]:
    probs = processed_probs(L5, [row(**kw)])[0]
    s = support(probs)
    # whatever survives keeps its relative probability (the temperature-1 cases)
    if kw.get("temperature", 1.0) == 1.0:
        expected = torch.zeros(5, dtype=torch.float64)
        idx = torch.tensor(sorted(s))
        expected[idx] = P5[idx] / P5[idx].sum()
        torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=0)
    return s


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (1, {2}),
        (2, {2, 4}),
        (3, {2, 4, 0}),
        (4, {2, 4, 0, 1}),
        (5, set(range(5))),
        (100, set(range(5))),
        (0, set(range(5))),
        (-1, set(range(5))),
    ],
)
def test_top_k_sets(top_k: int, expected: set[int]) -> None:
    assert kept(top_k=top_k) == expected


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1e-6, {2}),  # always at least the most likely token
        (0.1, {2}),
        (0.39, {2}),
        (0.45, {2, 4}),
        (0.65, {2, 4}),
        (0.75, {2, 4, 0}),
        (0.9, {2, 4, 0, 1}),
        (0.99, set(range(5))),
        (1.0, set(range(5))),
    ],
)
def test_top_p_sets(top_p: float, expected: set[int]) -> None:
    assert kept(top_p=top_p) == expected


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, set(range(5))), (0.1, set(range(5))), (0.2, {2, 4, 0, 1}), (0.3, {2, 4, 0}), (0.5, {2, 4}), (1.0, {2})],
)
def test_min_p_sets(min_p: float, expected: set[int]) -> None:
    assert kept(min_p=min_p) == expected


def test_top_p_applies_after_top_k_and_temperature() -> None:
    assert kept(top_p=0.5) == {2, 4}
    assert kept(top_k=2, top_p=0.5) == {2}  # after top-k, p(2) = 0.4 / 0.7 > 0.5
    assert kept(top_p=0.55) == {2, 4}
    assert kept(temperature=0.5, top_p=0.55) == {2}  # p**2 renormalised: p(2) = 0.561


def test_min_p_applies_after_temperature() -> None:
    assert kept(min_p=0.55) == {2, 4}
    assert kept(temperature=2.0, min_p=0.55) == {2, 4, 0}  # sqrt(p): 0.15 -> 0.387 / 0.632 = 0.61 of the max


def test_filters_are_per_row_in_a_batch() -> None:
    logits = L5.expand(4, 5).contiguous()  # [4, 5]
    rows = [row(top_k=1), row(), row(top_p=0.45), row(min_p=0.3)]
    probs = processed_probs(logits, rows)
    assert [support(p) for p in probs] == [{2}, set(range(5)), {2, 4}, {2, 4, 0}]
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(4))


# ------------------------------------------------------------------------ determinism

VOCAB = 40
SEEDED = SamplingParams(
    temperature=0.9, top_k=25, top_p=0.95, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.3, seed=1234
)


def _a_logits(step: int) -> torch.Tensor:  # [VOCAB]; the seeded row's logits depend only on the step
    return 2.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step))


def _run(layout: list[str], steps: int = 25, seed_a: int = 1234) -> dict[str, list[int]]:
    """Decode ``steps`` tokens for the rows named in ``layout``, in that order. 'A' and 'A2' are
    the seeded request (two copies); 'B' seeded differently; 'C' unseeded (a random seed);
    'D' greedy without a seed. Only A's logits are reproducible."""
    params = {
        "A": SEEDED,
        "A2": SEEDED,
        "B": SamplingParams(temperature=1.2, top_p=0.5, seed=5),
        "C": SamplingParams(temperature=0.7, min_p=0.1),
        "D": SamplingParams(temperature=0.0, frequency_penalty=1.0),
    }
    seeds = {"A": seed_a, "A2": seed_a, "B": 5, "C": int(torch.randint(2**62, ())), "D": None}
    outputs: dict[str, list[int]] = {name: [] for name in layout}
    prompts = {name: [1, 2, 3] for name in layout}
    sampler = Sampler()
    for step in range(steps):
        logits = torch.stack([_a_logits(step) if name.startswith("A") else 3.0 * torch.randn(VOCAB) for name in layout])
        rows = [SamplingRow(params[n], seeds[n], prompts[n], outputs[n], eos_token_ids=(0,)) for n in layout]
        for name, tok in zip(layout, sampler(logits, rows).token_ids, strict=True):
            outputs[name].append(tok)
    return outputs


def test_seeded_row_is_the_same_whatever_shares_its_batch() -> None:
    alone = _run(["A"])["A"]
    assert len(set(alone)) > 5, "the sequence must be non-trivial for the test to mean anything"
    for layout in (["B", "A", "C"], ["C", "D", "B", "A"], ["A", "D"], ["D", "A2", "C", "A", "B"]):
        torch.manual_seed(len(layout))  # the global RNG must not matter either
        out = _run(layout)
        assert out["A"] == alone, layout
        if "A2" in out:
            assert out["A2"] == alone


def test_a_different_seed_gives_a_different_sequence() -> None:
    assert _run(["A"])["A"] != _run(["A"], seed_a=4321)["A"]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_sorted_and_rank_the_sampled_token() -> None:
    raw = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, 1.0]] * 4)  # [4, 6]
    expected_lp = torch.log_softmax(raw[0], dim=-1)
    rows = [
        # presence penalty makes token 2 the greedy pick: rank 3 under the raw distribution
        row(temperature=0.0, output=[0, 1], presence_penalty=2.0, logprobs=3),
        row(temperature=0.0, logprobs=0),
        row(temperature=0.5, top_k=2, seed=9, logprobs=20),
        row(temperature=0.0),
    ]
    out = Sampler()(raw, rows)
    assert out.token_ids[:2] == [2, 0]
    first, second, third, fourth = out.logprobs
    assert first is not None and second is not None and third is not None and fourth is None
    assert first.token_id == 2 and first.rank == 3
    assert first.logprob == pytest.approx(float(expected_lp[2]), abs=1e-6)
    assert [t for t, _ in first.top] == [0, 1, 2]
    assert [v for _, v in first.top] == pytest.approx(expected_lp[[0, 1, 2]].tolist(), abs=1e-6)
    assert second.top == () and second.rank == 1 and second.logprob == pytest.approx(float(expected_lp[0]), abs=1e-6)
    # more requested than the vocabulary holds: all of it, sorted; raw (not temperature-scaled) values
    assert [t for t, _ in third.top] == [0, 1, 2, 5, 3, 4]
    values = [v for _, v in third.top]
    assert values == sorted(values, reverse=True)
    assert third.token_id == out.token_ids[2] in (0, 1)
    assert third.logprob == pytest.approx(float(expected_lp[third.token_id]), abs=1e-6)
    assert third.rank == third.token_id + 1


def test_rank_counts_only_strictly_more_likely_tokens() -> None:
    raw = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # [2, 3]: tokens 0 and 1 tie
    rows = [row(temperature=0.0, logprobs=1), row(temperature=0.0, output=[0], presence_penalty=1.0, logprobs=1)]
    out = Sampler()(raw, rows)
    assert out.token_ids == [0, 1]
    assert [lp.rank for lp in out.logprobs if lp is not None] == [1, 1]


# ------------------------------------------------------------------------ errors, edges


def test_sampled_row_without_seed_is_refused() -> None:
    r = SamplingRow(SamplingParams(temperature=0.8), None, [1], [])
    with pytest.raises(ValueError, match="no seed"):
        Sampler()(torch.zeros(1, 4), [r])


def test_logits_shape_must_match_rows() -> None:
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(torch.zeros(3, 4), [row(), row()])
    with pytest.raises(ValueError, match="num_rows=1"):
        processed_probs(torch.zeros(4), [row()])


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros(0, 8), [])
    assert out.token_ids == [] and out.logprobs == []
    assert processed_probs(torch.zeros(0, 8), []).shape == (0, 8)


def test_processed_probs_does_not_modify_logits_and_sums_to_one() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(7))  # [3, 20]
    before = logits.clone()
    rows = [
        row(temperature=0.6, top_k=5, output=[1, 1], repetition_penalty=1.3, frequency_penalty=0.5),
        row(min_tokens=4, stop_token_ids=[2], eos=[3], top_p=0.7),
        row(temperature=0.0, min_p=0.2),
    ]
    probs = processed_probs(logits, rows)
    assert torch.equal(logits, before)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))


def test_bfloat16_logits_are_accepted() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(8)).bfloat16()  # [2, 16]
    out = Sampler()(logits, [row(temperature=0.0, logprobs=2), row(seed=1, logprobs=1)])
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert all(lp is not None for lp in out.logprobs)


# ------------------------------------------------------------------------ statistics
#
# Every case draws N samples in one batch of N identical rows with the seeds base, base + 1,
# ...: the keyed noise of different seeds is independent, so the N draws are i.i.d. across
# seeds, and fixed seeds make every run of this test see exactly the same samples. The counts are
# compared with the intended distribution, computed independently below in float64 numpy,
# by a chi-square goodness-of-fit test that rejects at p < 1e-3. For a correct sampler the
# chance that a given seed lands in the rejection region is 0.1% per case; since the seeds
# are fixed, the outcome is decided once (it passed when written) and cannot flake -- only a
# change to the sampler or to the keyed noise can move it.
# Tokens the intended distribution excludes must not be drawn at all.

N = 20_000
ALPHA = 1e-3
LOGITS10 = [2.0, 1.6, 1.1, 0.9, 0.3, 0.0, -0.4, -1.0, -1.7, -2.5]


def reference(
    logits: Sequence[float],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:  # [vocab] float64
    """The intended distribution: temperature, then top-k, top-p, min-p, each renormalising."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(len(z), dtype=bool)

    def dist() -> np.ndarray:
        e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return e / e.sum()

    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][min(top_k, len(z)) - 1]
    if top_p < 1.0:
        p = dist()
        total = 0.0
        for i in np.argsort(-p, kind="stable"):
            if total >= top_p:
                keep[i] = False
            total += p[i]
    if min_p > 0.0:
        p = dist()
        keep &= p >= min_p * p.max()
    return dist()


def draw(params: SamplingParams, logits: Sequence[float] = LOGITS10, **row_kw: Any) -> np.ndarray:  # [vocab] counts
    base = N * (params.seed if params.seed is not None else 0)
    batch = torch.tensor([list(logits)] * N)  # [N, vocab]
    kw = {"prompt_token_ids": (), "output_token_ids": (), **row_kw}
    rows = [SamplingRow(params, base + i, **kw) for i in range(N)]
    tokens = Sampler()(batch, rows).token_ids
    return np.bincount(tokens, minlength=len(logits))


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of the counts under ``expected_probs``; any count where it is 0 gives p = 0.
    Cells expected below 5 are pooled, as the chi-square approximation wants."""
    if counts[expected_probs == 0].sum() > 0:
        return 0.0
    nz = expected_probs > 0
    obs, exp = counts[nz].astype(np.float64), expected_probs[nz] * counts.sum()
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return float(chisquare(obs, exp).pvalue)


STAT_CASES = {
    "temperature 0.7": (SamplingParams(temperature=0.7, seed=11), reference(LOGITS10, 0.7), set(range(10))),
    "temperature 1.3 + top-k 4": (
        SamplingParams(temperature=1.3, top_k=4, seed=12),
        reference(LOGITS10, 1.3, top_k=4),
        {0, 1, 2, 3},
    ),
    "top-p 0.8": (SamplingParams(top_p=0.8, seed=13), reference(LOGITS10, top_p=0.8), {0, 1, 2, 3}),
    "min-p 0.1": (SamplingParams(min_p=0.1, seed=14), reference(LOGITS10, min_p=0.1), set(range(6))),
}


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_sampled_distribution_matches(case: str) -> None:
    params, expected, expected_support = STAT_CASES[case]
    assert set(np.nonzero(expected)[0].tolist()) == expected_support  # the reference itself, pinned
    probs = processed_probs(torch.tensor([LOGITS10]), [SamplingRow(params, 0, (), ())])[0]
    np.testing.assert_allclose(probs.double().numpy(), expected, atol=1e-6)
    counts = draw(params)
    p = chi_square_p(counts, expected)
    assert p >= ALPHA, f"{case}: chi-square p = {p:.2e}, counts {counts.tolist()}"


def test_sampled_distribution_matches_for_a_combination_with_penalties() -> None:
    params = SamplingParams(
        temperature=0.9,
        top_k=7,
        top_p=0.85,
        min_p=0.3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        seed=15,
    )
    penalised = [2.0 / 1.2 - 0.5 - 0.5] + LOGITS10[1:]  # token 0: in the output twice
    penalised[2] = 1.1 / 1.2  # in the prompt
    penalised[6] = -0.4 * 1.2  # in the prompt, negative logit
    expected = reference(penalised, 0.9, top_k=7, top_p=0.85, min_p=0.3)
    assert set(np.nonzero(expected)[0].tolist()) == {0, 1, 2, 3}
    row_kw = {"prompt_token_ids": [2, 6], "output_token_ids": [0, 0]}
    probs = processed_probs(torch.tensor([LOGITS10]), [SamplingRow(params, 0, **row_kw)])[0]
    np.testing.assert_allclose(probs.double().numpy(), expected, atol=1e-6)
    p = chi_square_p(draw(params, **row_kw), expected)
    assert p >= ALPHA, f"chi-square p = {p:.2e}"


@pytest.mark.parametrize(
    ("sampled", "wrong"),
    [
        (SamplingParams(temperature=1.0, seed=21), reference(LOGITS10, 0.7)),  # temperature ignored
        (SamplingParams(temperature=1.3, top_k=4, seed=22), reference(LOGITS10, 1.0, top_k=4)),
        (SamplingParams(temperature=1.0, seed=24), reference(LOGITS10, 1.1)),  # same support, 10% off (p ~ 1e-19)
        (SamplingParams(top_p=0.8, seed=23), reference(LOGITS10, top_p=0.7)),  # draws a token the other excludes
    ],
    ids=["T1.0-vs-T0.7", "T1.3k4-vs-T1.0k4", "T1.0-vs-T1.1", "p0.8-vs-p0.7"],
)
def test_chi_square_rejects_a_wrong_distribution(sampled: SamplingParams, wrong: np.ndarray) -> None:
    """The statistical test has power: samples checked against a wrong distribution fail it."""
    assert chi_square_p(draw(sampled), wrong) < ALPHA
