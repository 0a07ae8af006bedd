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
    pol.update(st, 1, 0)  # failed probe: off again, twice as long
    assert [pol.choose_k(st, 1) for _ in range(11)] == [0] * 10 + [1]
    pol.update(st, 1, 0)  # and again: four times as long, and no longer
    assert [pol.choose_k(st, 1) for _ in range(21)] == [0] * 20 + [1]
    pol.update(st, 1, 0)
    assert [pol.choose_k(st, 1) for _ in range(21)] == [0] * 20 + [1]
    pol.update(st, 1, 1)  # successful probe: on, gently
    assert st.off_steps is None and st.cap == 1 and st.probes == 0
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
    c = CostModel(forget_after=10**6)
    for n in sizes:
        for _ in range(2):  # the first time of each size is dropped as a cold run
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


def _record(c: CostModel, size: int, *times: float) -> None:
    c.record_target(size, 99.0)  # the cold first run: dropped
    for t in times:
        c.record_target(size, t)


def test_cost_model_drops_cold_runs_and_keeps_the_fastest_recent_time():
    c = CostModel(window=3)
    assert c.target_time(4) is None
    c.record_target(4, 0.5)  # the first run of a shape: dropped
    assert c.target_time(4) is None and c.samples_at_or_below(4) == 0
    c.record_target(4, 0.02)
    c.record_target(4, 0.09)  # a burst of interference does not move it
    assert c.target_time(4) == pytest.approx(0.02)
    c.record_target(4, 0.03)
    c.record_target(4, 0.04)  # 0.02 left the window of 3
    assert c.target_time(4) == pytest.approx(0.03)
    assert c.samples_at_or_below(4) == 3 and c.samples_at_or_below(100) == 3 and c.samples_at_or_below(3) == 0


def test_cost_model_never_extrapolates_in_proportion():
    """The defect: with one measured size, time(1) was time(2) / 2 and time(k + 1) grew in
    proportion to k, so speculation could never look profitable at batch 1."""
    c = CostModel()
    _record(c, 2, 0.010)
    assert c.target_time(1) == pytest.approx(0.010)  # one size: flat (no slope measured)
    assert c.target_time(6) == pytest.approx(0.010)
    _record(c, 1, 0.009)
    _record(c, 4, 0.011)
    # least squares over (1, 9 ms), (2, 10 ms), (4, 11 ms): slope 27/42 ms per token
    assert c.target_time(3) == pytest.approx(0.0105)  # interpolated
    assert c.target_time(8) == pytest.approx(0.011 + 4 * 0.001 * 27 / 42)  # from the largest size, on the slope
    assert c.target_time(8) < 2 * c.target_time(4)


def test_cost_model_below_the_smallest_size():
    c = CostModel()
    _record(c, 64, 0.050)
    _record(c, 128, 0.090)  # slope 0.625 ms per token, intercept 10 ms
    assert c.target_time(32) == pytest.approx(0.030)
    assert c.target_time(1) == pytest.approx(0.010625)
    c = CostModel()
    _record(c, 4, 0.010)
    _record(c, 8, 0.030)  # the line through both would cross zero: fitted through the origin, slope 3.5 ms
    assert c.target_time(16) == pytest.approx(0.030 + 8 * 0.0035)
    assert c.target_time(1) == pytest.approx(0.010 / 4)  # never below proportional scaling


def test_cost_model_fit_is_never_decreasing():
    c = CostModel()
    _record(c, 1, 0.020)  # noisy: one token measured slower than two
    _record(c, 2, 0.010)
    assert c.target_time(5) == pytest.approx(0.010)  # slope clamped at 0
    assert c.target_time(1) == pytest.approx(0.010)  # and never dearer than a larger size


def test_cost_model_is_monotone():
    """Measured at batch 4 on a loaded machine: the plain step (4 tokens) timed in a burst of
    interference, verify steps (8, 16 tokens) in quiet moments. Taken at face value, verifying
    3 drafts for each of 4 requests looked cheaper than decoding them plainly."""
    c = CostModel()
    _record(c, 4, 0.0168)
    _record(c, 8, 0.0116)
    _record(c, 16, 0.0223)
    assert c.target_time(4) == pytest.approx(0.0116)
    assert c.target_time(6) == pytest.approx(0.0116)
    assert c.target_time(16) == pytest.approx(0.0223)
    times = [c.target_time(n) for n in range(1, 40)]
    assert times == sorted(times)


def test_cost_model_forgets_old_times():
    """A size measured only in a burst of interference looks too dear to choose, so it is
    never measured again unless its times expire; then it is estimated from the others."""
    c = CostModel(forget_after=10)
    _record(c, 4, 0.5)  # inflated
    for _ in range(10):
        c.record_target(1, 0.010)
    assert c.target_time(4) == pytest.approx(0.5)
    c.record_target(1, 0.010)  # 4's time is now more than 10 records old
    assert c.target_time(4) == pytest.approx(0.010)  # flat from the one size left


def test_cost_model_validates():
    with pytest.raises(ValueError, match="window"):
        CostModel(window=0)
    with pytest.raises(ValueError, match="size >= 1"):
        CostModel().record_target(0, 0.1)
    with pytest.raises(ValueError, match="seconds >= 0"):
        CostModel().record_draft(1, -1.0)


def _cpu_batch1_costs() -> CostModel:
    """What the engine measures at batch 1 on CPU (1 thread, default pair): plain 5.3 ms,
    verify 2-5 tokens 6-7.5 ms, a draft step 1 ms."""
    c = CostModel()
    for size, t in ((1, 0.0053), (2, 0.0062), (3, 0.0068), (5, 0.0075)):
        _record(c, size, t)
    c.record_draft(1, 0.1)
    c.record_draft(1, 0.001)
    return c


def test_memory_bound_batch1_speculation_pays():
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=5), _cpu_batch1_costs())
    assert pol.may_pay(1)
    st = pol.new_state()
    for _ in range(4):
        pol.update(st, 4, 4)
    assert pol.choose_k(st, 1) >= 4


def test_batch1_low_acceptance_backs_off_within_a_few_rounds():
    """Per-token acceptance 0.25 (held-out code, default pair): one drafted token yields 1.25
    tokens for 6.2 + 1 ms against 5.3 ms plain: it does not pay, and the policy must see it
    within a few rounds, not after its window."""
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=5), _cpu_batch1_costs())
    st = pol.new_state()
    ks = []
    for i in range(80):
        k = pol.choose_k(st, 1)
        ks.append(k)
        if k:
            pol.update(st, k, 1 if i % 4 == 0 else 0)  # per-token acceptance about 0.25
    assert ks[0] > 0  # the prior (0.7) says try
    first_zero = ks.index(0)
    assert first_zero <= 6
    assert sum(1 for k in ks[first_zero:] if k) <= 8  # then only a probe now and then (k = 1)
    assert max(ks[first_zero:]) <= 1


def test_batch1_high_acceptance_keeps_speculating():
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=5), _cpu_batch1_costs())
    st = pol.new_state()
    ks = []
    for _ in range(50):
        k = pol.choose_k(st, 1)
        ks.append(k)
        pol.update(st, k, k if len(ks) % 4 else k - 1)  # per-token acceptance about 0.9
    assert min(ks) >= 2 and ks[-40:] == [5] * 40


def test_measure_plain_times_plain_steps_first_then_now_and_then():
    pol = SpeculationPolicy(PolicyConfig(min_plain_samples=2, measure_gap=3, remeasure_every=10))
    assert pol.measure_plain(1)  # nothing measured: a plain step first
    assert not pol.measure_plain(1)
    assert not pol.measure_plain(1)
    assert pol.measure_plain(1)  # still nothing: again, measure_gap steps later (a prefill may have mixed in)
    pol.costs.record_target(1, 0.1)  # cold, dropped
    pol.costs.record_target(1, 0.005)
    pol.costs.record_target(1, 0.005)
    got = [pol.measure_plain(1) for _ in range(20)]
    assert got == [False] * 9 + [True] + [False] * 9 + [True]  # once every remeasure_every steps
    assert pol.measure_plain(4) is False  # size 1 counts for batch 4 (a measured size below)
    pol2 = SpeculationPolicy()
    pol2.costs.record_target(8, 0.1)
    pol2.costs.record_target(8, 0.1)
    pol2._since_plain = 0
    assert [pol2.measure_plain(4) for _ in range(4)] == [False, False, False, True]  # nothing at or below 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_k=0), "max_k"),
        (dict(initial_k=9), "initial_k"),
        (dict(lower_below=0.9, raise_above=0.8), "lower_below"),
        (dict(off_after=0), "off_after"),
        (dict(prior_acceptance=1.0), "prior_acceptance"),
        (dict(margin=0.9), "margin"),
        (dict(measure_gap=0), "measure_gap"),
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
    assert [pol.choose_k(st, 1) for _ in range(9)] == [0] * 8 + [1]  # a probe that changed nothing: twice the wait
    for _ in range(16):
        pol.update(st, 1, 1)  # the draft agrees again: the costs choose k > 0, the wait is reset
    assert pol.choose_k(st, 1) > 0 and st.probes == 0


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
    assert pol.estimate(st) == pol.prior() == pytest.approx(0.5)
    pol.update(st, 4, 0)  # one empty round (one rejection): not yet hopeless
    assert pol.prior() == pytest.approx(2 / 5)  # the pooled rounds, smoothed towards prior_acceptance
    assert pol.estimate(st) == pytest.approx((0 + 4 * 2 / 5) / (1 + 4))
    pol.update(st, 4, 4)  # four acceptances, no rejection
    assert pol.prior() == pytest.approx(6 / 9)
    assert pol.estimate(st) == pytest.approx((4 + 4 * 6 / 9) / (5 + 4))


def test_a_new_request_starts_from_what_recent_rounds_were_accepted_at():
    """A head accepted about half the time: a new request is assumed accepted about half the
    time, not at prior_acceptance (0.7), and only the last pool_window rounds count."""
    pol = SpeculationPolicy(PolicyConfig(pool_window=100))
    for _ in range(150):
        pol.update(pol.new_state(), 4, 1)  # one accepted, then a rejection: per-token 0.5
    assert pol.estimate(pol.new_state()) == pol.prior() == pytest.approx((100 + 0.7 * 2) / (200 + 2))
    for _ in range(100):
        pol.update(pol.new_state(), 2, 2)  # the old rounds drop out
    assert pol.prior() == pytest.approx((200 + 0.7 * 2) / (0 + 200 + 2))


def test_drafts_granted_together_where_none_pays_alone():
    """Batch 4, a draft step costing a fifth of a plain step whatever its batch: one request
    drafting alone bears it all and cannot pay; four sharing it do."""
    costs = _costs(per_token=1e-4, fixed=10e-3, draft_fixed=2e-3, draft_per_seq=5e-5, sizes=range(1, 100))
    pol = SpeculationPolicy(PolicyConfig(initial_k=2), costs)
    states = [pol.new_state() for _ in range(4)]
    for st in states:
        for _ in range(8):
            pol.update(st, 2, 1)  # per-token acceptance 0.5
    assert pol.choose_k(pol.new_state(), 4) == 0
    ks = pol.choose_ks(states, 4)
    assert ks == [ks[0]] * 4 and ks[0] > 0, ks


def test_at_batch_64_only_the_requests_that_raise_the_step_draft():
    """Four requests accepted 90% of the time and sixty accepted 30%, a forward pass costing
    0.1 ms a token over 10 ms: drafting the four raises the step's tokens per second, each of
    the sixty would lower it (a drafted token's verify row costs more than the 0.3 tokens it
    adds). (At 0.02 ms a token all 64 drafting one token each is the best step, and chosen.)"""
    costs = _costs(per_token=1e-4, fixed=10e-3, draft_fixed=1e-4, draft_per_seq=2e-6, sizes=range(1, 600))
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=4, prior_weight=0.0), costs)
    good, poor = [pol.new_state() for _ in range(4)], [pol.new_state() for _ in range(60)]
    for i in range(10):
        for st in good:
            pol.update(st, 10, 9)  # per token: 9 accepted, 1 rejected
        for st in poor:
            pol.update(st, 1, int(i < 3))  # 3 accepted, 7 rejected
        for st in poor:
            st.cap = 4
    ks = pol.choose_ks(poor[:30] + good + poor[30:], 64)
    assert ks[30] > 0 and ks[30:34] == [ks[30]] * 4 and sum(ks) == 4 * ks[30], ks


def test_a_request_drafts_no_more_than_its_room():
    pol = SpeculationPolicy(PolicyConfig(initial_k=4))
    a, b, c = pol.new_state(), pol.new_state(), pol.new_state()
    assert pol.choose_ks([a, b, c], 3, rooms=[0, 2, 9]) == [0, 2, 4]  # nothing measured: the caps, within the rooms


def test_one_time_taken_in_a_burst_does_not_switch_drafting_off():
    """The engine's cost model wants two times of a size before it believes it: a draft step
    timed once in a burst of interference (100 ms, not 0.1) priced every draft out, even at
    perfect acceptance, so nothing was probed again (CI: a 32-token reply drafted nothing)."""
    costs = CostModel(min_samples=2)
    for _ in range(3):
        for n in (1, 2, 3, 4, 5):
            costs.record_target(n, 0.010)
    costs.record_draft(1, 0.5)  # cold: dropped
    costs.record_draft(1, 0.100)  # the burst
    pol = SpeculationPolicy(PolicyConfig(initial_k=4), costs)
    assert costs.draft_time(1) is None and pol.choose_k(pol.new_state(), 1) == 4  # not priced yet: drafts
    costs.record_draft(1, 0.0001)
    assert costs.draft_time(1) == 0.0001 and pol.choose_k(pol.new_state(), 1) == 4
    with pytest.raises(ValueError, match="min_samples"):
        CostModel(window=3, min_samples=4)


def _priced(verify_over_plain: float, draft_over_plain: float) -> SpeculationPolicy:
    """A policy whose cost model holds steady step times (plain 10 ms at 1 and 2 tokens, so
    verify at n + k extrapolates flat from the measured sizes when verify_over_plain is 1)."""
    pol = SpeculationPolicy()
    for _ in range(2):  # a size's first time is dropped as a cold run
        for n in (1, 2, 3, 4, 5):
            pol.costs.record_target(n, 0.010 * (1.0 if n == 1 else verify_over_plain))
        pol.costs.record_draft(1, 0.010 * draft_over_plain)
    return pol


def test_once_priced_a_zero_streak_leaves_the_decision_to_the_costs():
    """Three empty rounds switch a request off only while the costs cannot price a round: a
    drafter accepted 40% of the time (three empty rounds in a row a fifth of the time) keeps
    drafting where verifying costs 1.05 plain steps; where drafting cannot pay, the costs say 0."""
    cheap = _priced(1.05, 0.07)
    assert cheap.priced()
    st = cheap.new_state()
    for _ in range(3):
        cheap.update(st, 1, 0)
    assert st.off_steps is None
    for _ in range(6):
        cheap.update(st, 1, 1)
        cheap.update(st, 1, 0)
    assert cheap.estimate(st) < 0.6 and cheap.choose_k(st, 1) >= 1  # about 0.5 acceptance: still drafts
    dear = _priced(2.0, 0.5)  # verifying costs two plain steps: 0.5 acceptance cannot pay
    st = dear.new_state()
    for _ in range(3):
        dear.update(st, 1, 0)
    assert st.off_steps is None and dear.choose_k(st, 1) == 0
    unpriced = SpeculationPolicy()
    assert not unpriced.priced()
    st = unpriced.new_state()
    for _ in range(3):
        unpriced.update(st, 1, 0)
    assert st.off_steps == 0  # nothing timed yet: the streak rule still applies


def test_a_step_is_never_planned_far_beyond_the_sizes_measured():
    """Measured up to 64 tokens with a fit that says a token costs next to nothing: drafting
    4 tokens for each of 64 requests (320 tokens) would look free. The step may reach the
    largest measured size plus a quarter (80 tokens): 16 drafted tokens; once 80 is measured,
    100; draft steps not timed yet count as free (the grant is how they get timed)."""
    costs = CostModel(min_samples=2)
    for n in (1, 8, 64):
        for _ in range(3):  # the first dropped, 2 kept
            costs.record_target(n, 0.010 + 1e-6 * n)
    assert costs.trusted_size() == 80 and costs.draft_time(1) is None
    pol = SpeculationPolicy(PolicyConfig(initial_k=4, max_k=4), costs)
    states = [pol.new_state() for _ in range(64)]
    assert sum(pol.choose_ks(states, 64)) == 16
    for _ in range(3):
        costs.record_target(80, 0.010 + 1e-6 * 80)
    assert costs.trusted_size() == 100 and sum(pol.choose_ks(states, 64)) == 36
