"""The speculation policy: acceptance moves each request's cap, three empty rounds switch it
off, probes switch it back on, and measured costs pick the k (zero included) that pays."""

from __future__ import annotations

import pytest

from draftwise.worker.speculative.policy import CostModel, PolicyConfig, SpeculationPolicy, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.7, 4) == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)


def test_cap_rises_and_falls_with_acceptance():
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=6, window=2))
    st = pol.new_state()
    assert st.cap == 4
    pol.update(st, 4, 4)  # per-token acceptance 4 / 4
    assert st.cap == 5
    pol.update(st, 5, 5)
    pol.update(st, 6, 6)
    assert st.cap == 6  # never above max_k
    pol.update(st, 6, 1)  # window (6,6), (6,1): 7 accepted, 1 rejection: 0.875, stays at max
    assert st.cap == 6
    pol.update(st, 2, 1)  # window (6,1), (2,1): 2 accepted, 2 rejections: 0.5, between the bounds
    assert st.cap == 6
    pol.update(st, 3, 0)  # window (2,1), (3,0): 1 / 3 -> lower
    assert st.cap == 5
    pol.update(st, 4, 1)  # window (3,0), (4,1): 1 / 3 -> lower
    assert st.cap == 4
    assert st.proposed == 30 and st.accepted == 18 and st.verify_steps == 7


def test_acceptance_estimate_does_not_depend_on_k():
    """Drafts accepted token by token with probability 0.7: the per-token estimate is 0.7
    whatever k (accepted / proposed would be 0.7 at k = 1 but 0.42 at k = 4 and would
    push k down)."""
    import random

    rng = random.Random(5)
    for k in (1, 4, 8):
        st = SpeculationPolicy(PolicyConfig(window=4000, max_k=8)).new_state()
        for _ in range(4000):
            a = 0
            while a < k and rng.random() < 0.7:
                a += 1
            st.rounds.append((k, a))
        assert st.acceptance_rate == pytest.approx(0.7, abs=0.02)


def test_three_empty_rounds_switch_off_then_probe():
    pol = SpeculationPolicy(PolicyConfig(off_after=3, probe_after=5))
    st = pol.new_state()
    for _ in range(3):
        pol.update(st, 4, 0)
    assert st.off_steps == 0
    assert [pol.choose_k(st, 1) for _ in range(5)] == [0] * 5
    assert pol.choose_k(st, 1) == 1  # the probe
    pol.update(st, 1, 0)  # failed probe: off again for probe_after steps
    assert [pol.choose_k(st, 1) for _ in range(6)] == [0, 0, 0, 0, 0, 1]
    pol.update(st, 1, 1)  # successful probe: on, gently
    assert st.off_steps is None and st.cap == 1
    assert pol.choose_k(st, 1) == 1


def test_some_acceptance_breaks_the_zero_streak():
    pol = SpeculationPolicy(PolicyConfig(off_after=3))
    st = pol.new_state()
    pol.update(st, 4, 0)
    pol.update(st, 4, 0)
    pol.update(st, 4, 1)
    pol.update(st, 4, 0)
    assert st.off_steps is None


def test_request_cap_respected():
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=8))
    st = pol.new_state(cap=2)
    assert st.cap == 2 and st.limit == 2
    for _ in range(5):
        pol.update(st, 2, 2)
    assert st.cap == 2
    off = pol.new_state(cap=0)
    assert pol.choose_k(off, 1) == 0


def test_without_measurements_acceptance_decides():
    pol = SpeculationPolicy()
    st = pol.new_state()
    assert pol.choose_k(st, 1) == st.cap


def _costs(per_token: float, fixed: float, draft_fixed: float, draft_per_seq: float, sizes: range) -> CostModel:
    c = CostModel()
    for n in sizes:
        c.record_target(n, fixed + per_token * n)
        c.record_draft(n, draft_fixed + draft_per_seq * n)
    return c


def test_costs_pick_k_small_batch_memory_bound():
    # batch 1: a forward costs the same for 1 or 9 tokens (weights dominate): speculate fully
    costs = _costs(per_token=1e-5, fixed=8e-3, draft_fixed=1e-3, draft_per_seq=1e-6, sizes=range(1, 700))
    pol = SpeculationPolicy(PolicyConfig(initial_k=4), costs)
    st = pol.new_state()
    for _ in range(4):
        pol.update(st, 4, 4)
    assert pol.choose_k(st, 1) == st.cap >= 4


def test_costs_switch_off_at_large_batch():
    # batch 256: a forward costs per token; verifying k drafts costs k times more, drafts too
    costs = _costs(per_token=1e-4, fixed=8e-3, draft_fixed=1e-3, draft_per_seq=8e-5, sizes=range(1, 2400))
    pol = SpeculationPolicy(PolicyConfig(initial_k=4), costs)
    st = pol.new_state()
    pol.update(st, 4, 3)
    assert pol.choose_k(st, 256) == 0
    assert pol.choose_k(st, 1) > 0  # the same request at batch 1 still speculates


def test_cost_model_nearest_and_smoothing():
    c = CostModel(alpha=0.5)
    assert c.target_time(4) is None
    c.record_target(4, 1.0)
    c.record_target(4, 3.0)
    assert c.target_time(4) == pytest.approx(2.0)
    assert c.target_time(8) == pytest.approx(4.0)  # scaled from the nearest measurement
    assert c.target_time(2) == pytest.approx(1.0)
    c.record_target(12, 6.0)
    assert c.target_time(8) == pytest.approx(4.0)  # interpolated between 4 (2.0) and 12 (6.0)
    c.record_target(12, 2.0)  # smoothed: 6.0 -> 4.0
    assert c.target_time(6) == pytest.approx(2.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_k=0), "max_k"),
        (dict(initial_k=9), "initial_k"),
        (dict(lower_below=0.9, raise_above=0.8), "lower_below"),
        (dict(off_after=0), "off_after"),
        (dict(prior_acceptance=1.0), "prior_acceptance"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**kwargs)


def test_update_validates():
    pol = SpeculationPolicy()
    with pytest.raises(ValueError, match="accepted"):
        pol.update(pol.new_state(), 2, 3)


def test_costs_choosing_zero_still_probe_and_recover():
    # Batch 1, memory-bound target but an expensive draft: k = 0 at a poor estimate, yet
    # perfect acceptance would pay, so after probe_after such steps the request probes with
    # k = 1: it never stays without fresh acceptance data forever.
    costs = _costs(per_token=1e-5, fixed=8e-3, draft_fixed=6e-3, draft_per_seq=1e-6, sizes=range(1, 700))
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, probe_after=4), costs)
    st = pol.new_state()
    for _ in range(3):
        pol.update(st, 1, 0)
        st.zero_streak = 0  # keep it on: this test is about the cost layer
    assert pol.estimate(st) < 0.5
    assert [pol.choose_k(st, 1) for _ in range(5)] == [0, 0, 0, 0, 1]
    assert pol.choose_k(st, 1) == 0  # the count starts again


def test_no_probes_where_even_perfect_acceptance_would_not_pay():
    # batch 256, compute-bound: verifying k drafts costs k times more; no probe ever
    costs = _costs(per_token=1e-4, fixed=8e-3, draft_fixed=1e-3, draft_per_seq=8e-5, sizes=range(1, 2400))
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, probe_after=4), costs)
    st = pol.new_state()
    assert [pol.choose_k(st, 256) for _ in range(20)] == [0] * 20
    assert pol.choose_k(st, 1) > 0 and st.idle_steps == 0  # batch 1 still speculates
    assert not pol.may_pay(256) and pol.may_pay(1)  # the engine skips the per-request questions at 256
    assert pol.may_pay(256, adaptive=False)  # a fixed k is the user's call


def test_estimate_is_smoothed_towards_the_prior():
    pol = SpeculationPolicy(PolicyConfig(prior_acceptance=0.5, prior_weight=4.0))
    st = pol.new_state()
    assert pol.estimate(st) == pytest.approx(0.5)
    pol.update(st, 4, 0)  # one empty round (one rejection): not yet hopeless
    assert pol.estimate(st) == pytest.approx(2 / 5)
    pol.update(st, 4, 4)  # four acceptances, no rejection
    assert pol.estimate(st) == pytest.approx(6 / 9)
