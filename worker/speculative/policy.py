"""How many tokens to speculate, per request per step (docs/engine.md, "Speculative decoding").

Two layers:

1. **Acceptance**: each request keeps the per-token acceptance of its recent rounds (the
   chance that a drafted token is accepted given the ones before it were). Its cap on k rises
   by one while acceptance is above ``raise_above``, falls by one below ``lower_below``. Until
   the costs are measured (layer 2 cannot price a round yet), after ``off_after`` rounds in a
   row with nothing accepted speculation goes off for the request, and after ``probe_after``
   plain steps it is probed again with k = 1 (the wait doubles with each failed probe in a
   row, up to four times); once they are, the cost layer alone switches drafting off and on.
2. **Cost**: the engine records how long draft steps and verify steps take at each batch
   size (``CostModel``). Given an acceptance rate a, k drafted tokens yield on average
   (1 - a^(k+1)) / (1 - a) tokens per step; a step's drafts are granted together
   (``StepPrice``): the j likeliest requests draft up to D tokens each, the (j, D) giving the
   step the most tokens per second, so speculation switches itself down where batches are
   large. A request for which the costs chose k = 0
   ``probe_after`` steps in a row speculates once with k = 1 (its estimate and the costs stay
   current) unless even perfect acceptance would not pay at this batch size.

The acceptance estimate is smoothed towards the prior (what the last rounds of all requests
were accepted at) with ``prior_weight`` pseudo-observations, so that one unlucky round does
not decide a request's fate. Drafting is
chosen only when it promises ``margin`` times plain's tokens per second. The plain step's
cost is what everything is weighed against, so ``measure_plain`` asks the engine for a timed
plain step while it is unknown at the current batch size, and now and then after that (see
``CostModel`` for how times are kept and extrapolated).
(What requests report, accepted over proposed, is a different number: it falls with k.)
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the speculation policy."""

    max_k: int = 8  # the most tokens ever drafted in one step
    initial_k: int = 4  # a new request's cap
    raise_above: float = 0.8  # acceptance over the window above which the cap rises
    lower_below: float = 0.5  # acceptance below which the cap falls
    off_after: int = 3  # rounds in a row with nothing accepted before speculation goes off
    probe_after: int = 32  # plain steps after which an off request is probed again
    window: int = 16  # rounds of history behind the acceptance estimate
    prior_acceptance: float = 0.7  # acceptance assumed before a request has any history
    prior_weight: float = 2.0  # pseudo-observations of the prior mixed into a request's estimate
    pool_window: int = 256  # rounds of all requests behind the prior (see SpeculationPolicy.prior)
    margin: float = 1.03  # drafting must promise this many times plain's tokens/s to be chosen
    min_plain_samples: int = 3  # plain-step times wanted at a batch size before trusting them
    measure_gap: int = 4  # steps between two forced plain steps while those are missing
    remeasure_every: int = 64  # speculating steps after which one plain step refreshes its cost

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 1 <= self.initial_k <= self.max_k:
            raise ValueError(f"initial_k must be in [1, max_k={self.max_k}], got {self.initial_k}")
        if not 0.0 <= self.lower_below <= self.raise_above <= 1.0:
            raise ValueError("need 0 <= lower_below <= raise_above <= 1")
        if self.off_after < 1 or self.probe_after < 1 or self.window < 1 or self.pool_window < 1:
            raise ValueError("off_after, probe_after, window and pool_window must be >= 1")
        if not 0.0 <= self.prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1), got {self.prior_acceptance}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")
        if self.margin < 1.0:
            raise ValueError(f"margin must be >= 1, got {self.margin}")
        if self.min_plain_samples < 0 or self.measure_gap < 1 or self.remeasure_every < 1:
            raise ValueError("need min_plain_samples >= 0, measure_gap >= 1 and remeasure_every >= 1")


@dataclass
class RequestSpecState:
    """One request's speculation history."""

    cap: int  # the most tokens this request may draft now
    limit: int  # the most it may ever draft (the policy's max_k, or less if the request asks)
    rounds: deque[tuple[int, int]] = field(default_factory=deque)  # recent (proposed, accepted)
    zero_streak: int = 0  # rounds in a row with nothing accepted
    off_steps: int | None = None  # plain steps since speculation went off (None: on)
    idle_steps: int = 0  # steps in a row for which the costs chose k = 0
    probes: int = 0  # probes in a row that did not bring speculation back (each doubles the wait, up to 4x)
    proposed: int = 0  # totals, for reporting
    accepted: int = 0
    verify_steps: int = 0  # verified rounds with at least one drafted token

    @property
    def acceptance_rate(self) -> float | None:
        """Per-token acceptance over the window, None without history: the chance that a
        drafted token is accepted given that the ones before it were. A round of k drafts
        with a accepted shows a acceptances and, when a < k, one rejection (the positions
        after it are never tested), so the estimate is accepted / (accepted + rejections).
        Accepted over proposed would be biased low for large k and push k down."""
        accepted = sum(a for _, a in self.rounds)
        rejected = sum(1 for k, a in self.rounds if a < k)
        return None if accepted + rejected == 0 else accepted / (accepted + rejected)


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens a step yields with k drafted tokens, each accepted with probability
    ``acceptance`` independently: 1 + a + ... + a^k."""
    if k == 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class CostModel:
    """Measured step times by size, and what they say about sizes not measured.

    * **Cold runs dropped**: the first time recorded for a size is discarded (the first run of
      a shape pays one-time costs, up to a hundred times a warm step on CPU).
    * **Fastest recent time**: each size keeps the fastest of its last ``window`` times.
      Interference (other processes on the cores, page faults) only ever adds time, in
      bursts that would move a mean or a median for many steps.
    * **Forgetting**: a time older than ``forget_after`` records (of either table) drops out,
      and a size with none left is no longer measured. A size whose cost once looked inflated
      is not chosen again, so without this it would never be measured again either; once
      forgotten it is estimated from the others, tried, and measured afresh.
    * **Monotone**: a size is never taken as dearer than a larger one (its times were taken
      in a noisier moment; a forward pass over more tokens does not cost less). Without this,
      a plain step timed during interference next to a verify step timed in a quiet moment
      makes drafting look free.
    * **Enough samples**: a size with fewer than ``min_samples`` current times counts as not
      measured yet (the engine asks for 2). One time taken in a burst of interference made a
      size look so dear that it was never chosen, so never measured again: a 32-token reply with
      n-gram lookup on a repeating prompt drafted nothing (it looked unpayable even with perfect
      acceptance, so not even probed). Estimated from the others, the size is tried again.
    * **Sizes not measured**: between two measured sizes, linear interpolation; outside
      them, an affine fit ``a + b * size`` over all measured sizes (least squares, ``a >= 0``,
      ``b >= 0``) anchored at the nearest one. Time is never assumed proportional to size: a
      forward pass over a few tokens costs about what one token costs (it reads the same
      weights). With a single measured size there is no slope yet and the time is taken as
      flat (the next speculating step measures a second size); below the smallest measured
      size it is never less than proportional scaling would give.
    """

    def __init__(self, window: int = 9, forget_after: int = 256, min_samples: int = 1) -> None:
        if window < 1 or forget_after < 1 or not 1 <= min_samples <= window:
            raise ValueError(
                f"need window >= 1, forget_after >= 1 and 1 <= min_samples <= window, got {window}, {forget_after}, "
                f"{min_samples}"
            )
        self.window = window
        self.forget_after = forget_after
        self.min_samples = min_samples
        self._verify: dict[int, deque[tuple[int, float]]] = {}  # forward tokens -> recent (version, seconds)
        self._draft: dict[int, deque[tuple[int, float]]] = {}  # sequences in a draft step -> the same
        self._seen: dict[int, set[int]] = {id(self._verify): set(), id(self._draft): set()}  # sizes seen once
        self._cache: dict[int, tuple[int, list[int], dict[int, float], float]] = {}
        self.version = 0  # bumped on every record: the policy's cached decisions go stale

    def record_target(self, num_tokens: int, seconds: float) -> None:
        self._update(self._verify, num_tokens, seconds)

    def record_draft(self, num_seqs: int, seconds: float) -> None:
        self._update(self._draft, num_seqs, seconds)

    def samples_at_or_below(self, num_tokens: int) -> int:
        """Current times held for the largest measured target size <= ``num_tokens`` (0: none)."""
        keys, _, _ = self._summary(self._verify)
        i = bisect.bisect_right(keys, num_tokens)
        if i == 0:
            return 0
        oldest = self.version - self.forget_after
        return sum(1 for v, _ in self._verify[keys[i - 1]] if v > oldest)

    def _update(self, table: dict[int, deque[tuple[int, float]]], key: int, seconds: float) -> None:
        if key < 1 or not seconds >= 0:
            raise ValueError(f"a cost needs size >= 1 and seconds >= 0, got size {key}, {seconds} s")
        seen = self._seen[id(table)]
        if key not in seen:  # a shape's first run pays one-time costs
            seen.add(key)
            return
        self.version += 1
        table.setdefault(key, deque(maxlen=self.window)).append((self.version, seconds))

    def _summary(self, table: dict[int, deque[tuple[int, float]]]) -> tuple[list[int], dict[int, float], float]:
        """(sorted measured sizes, time per size, slope of the affine fit), current times only."""
        got = self._cache.get(id(table))
        if got is not None and got[0] == self.version:
            return got[1], got[2], got[3]
        oldest = self.version - self.forget_after
        current = {k: [t for v, t in d if v > oldest] for k, d in table.items()}
        times = {k: min(ts) for k, ts in current.items() if len(ts) >= self.min_samples}
        keys = sorted(times)
        for small, big in zip(reversed(keys[:-1]), reversed(keys[1:]), strict=True):
            times[small] = min(times[small], times[big])  # more tokens never cost less
        slope = _affine_slope([(k, times[k]) for k in keys])
        self._cache[id(table)] = (self.version, keys, times, slope)
        return keys, times, slope

    def _lookup(self, table: dict[int, deque[tuple[int, float]]], key: int) -> float | None:
        keys, times, slope = self._summary(table)
        if not keys:
            return None
        got = times.get(key)
        if got is not None:
            return got
        i = bisect.bisect_left(keys, key)
        if 0 < i < len(keys):
            below, above = keys[i - 1], keys[i]
            w = (key - below) / (above - below)
            return (1 - w) * times[below] + w * times[above]
        if i == len(keys):  # above every measured size
            return times[keys[-1]] + slope * (key - keys[-1])
        smallest = keys[0]
        return max(times[smallest] - slope * (smallest - key), times[smallest] * key / smallest)

    def trusted_size(self) -> int:
        """The largest forward size a step may be planned at: the largest measured one plus a
        quarter (at least 8). Sizes beyond the measured ones are extrapolated from the fit,
        whose slope comes from the small sizes where a CPU pass costs about the same for 1 or 9
        tokens: planned at once, the verify passes at batch 64 ran 100 tokens beyond what was
        measured and cost twice the estimate. Grown step by step, the sizes get measured."""
        keys, _, _ = self._summary(self._verify)
        return keys[-1] + max(8, keys[-1] // 4) if keys else 0

    def target_time(self, num_tokens: int) -> float | None:
        return self._lookup(self._verify, num_tokens)

    def draft_time(self, num_seqs: int) -> float | None:
        return self._lookup(self._draft, num_seqs)


def _affine_slope(points: list[tuple[int, float]]) -> float:
    """Slope b of the least-squares fit t = a + b * n with a >= 0 and b >= 0 (0 with fewer
    than two sizes)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    if my - b * mx < 0:  # the intercept would be negative: the best fit through the origin
        b = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return b


class SpeculationPolicy:
    def __init__(self, config: PolicyConfig | None = None, costs: CostModel | None = None) -> None:
        self.config = config or PolicyConfig()
        self.costs = costs or CostModel()
        self._memo: dict[tuple[float, int, int], int] = {}
        self._memo_version = -1
        self._since_plain = self.config.remeasure_every  # steps since the last forced plain step
        self._pool: deque[tuple[int, int]] = deque()  # (accepted, rejections) of recent rounds of any request
        self._pool_accepted = self._pool_rejected = 0  # their sums

    def measure_plain(self, batch_size: int) -> bool:
        """Whether this step (one that could speculate, at ``batch_size``) should decode plainly
        so that the cost of a plain step gets measured: while the largest measured forward size
        at or below ``batch_size`` has fewer than ``min_plain_samples`` times (at most every
        ``measure_gap`` steps: a step mixing prompt chunks is not timed, and must not hold
        speculation off), and once every ``remeasure_every`` steps to keep it current. Without
        it a request that always speculates would compare against a plain cost never measured."""
        cfg = self.config
        self._since_plain += 1
        wanted = self.costs.samples_at_or_below(batch_size) < cfg.min_plain_samples
        if self._since_plain >= cfg.remeasure_every or (wanted and self._since_plain >= cfg.measure_gap):
            self._since_plain = 0
            return True
        return False

    def new_state(self, cap: int | None = None) -> RequestSpecState:
        """State for a new request; ``cap`` is its own limit on k (from its SamplingParams)."""
        limit = self.config.max_k if cap is None else max(0, min(cap, self.config.max_k))
        return RequestSpecState(cap=min(self.config.initial_k, limit), limit=limit)

    def choose_ks(
        self, states: Sequence[RequestSpecState], batch_size: int, rooms: Sequence[int] | None = None
    ) -> list[int]:
        """Tokens to draft for each decoding request of a step of ``batch_size`` requests (0:
        a plain decode step), at most ``rooms[i]`` for the i-th (what is left of its budget).
        Requests switched off wait or probe; the others are granted drafts together
        (:meth:`StepPrice.grant`), and one granted none for ``probe_wait`` steps probes."""
        ks, free, caps = [0] * len(states), [], []
        for i, st in enumerate(states):
            cap = st.cap if rooms is None else max(0, min(st.cap, rooms[i]))
            if cap == 0:
                continue
            if st.off_steps is None:
                free.append(i)
                caps.append(cap)
            elif st.off_steps < self.probe_wait(st):
                st.off_steps += 1
            else:
                ks[i] = 1  # probe
        granted = StepPrice(self, batch_size, sum(ks)).grant([self.estimate(states[i]) for i in free], caps)
        for i, k in zip(free, granted, strict=True):
            st = states[i]
            if k > 0:
                ks[i], st.idle_steps, st.probes = k, 0, 0
            elif self._best_k(1.0, st.cap, batch_size) > 0:  # else not even perfect acceptance pays here
                st.idle_steps += 1
                if st.idle_steps > self.probe_wait(st):
                    st.idle_steps, ks[i] = 0, 1  # re-measure: acceptance and costs move
                    st.probes += 1
        return ks

    def choose_k(self, state: RequestSpecState, batch_size: int) -> int:
        """Tokens to draft for this request this step (0: a plain decode step), the only one
        that may draft among ``batch_size``."""
        return self.choose_ks([state], batch_size)[0]

    def priced(self) -> bool:
        """Whether the cost layer can price a round (plain and draft steps measured). Then it
        alone decides whether a request drafts, from its smoothed acceptance, and a zero
        streak does not switch speculation off: three empty rounds in a row happen a fifth of
        the time to a drafter accepted 40% of the time, which pays where a verify pass costs
        little more than a plain step (a trained head on the CPU kernel: docs/benchmarks.md),
        and the off state's doubling probe waits kept such a drafter off most of the time."""
        return self.costs.target_time(1) is not None and self.costs.draft_time(1) is not None

    def probe_wait(self, state: RequestSpecState) -> int:
        """Plain steps before the next probe: ``probe_after``, doubled for each probe in a row
        that did not bring speculation back, up to four times (a probe costs a draft catch-up
        and a wider verify step; on text the draft cannot predict they would add up)."""
        return self.config.probe_after << min(state.probes, 2)

    def may_pay(self, batch_size: int, adaptive: bool = True) -> bool:
        """Whether drafting could pay at this batch size at all (with perfect acceptance and
        the largest k); False lets the engine skip the per-request decisions entirely."""
        return not adaptive or batch_size == 0 or self._best_k(1.0, self.config.max_k, batch_size) > 0

    def estimate(self, state: RequestSpecState) -> float:
        """Per-token acceptance over the window (see RequestSpecState.acceptance_rate),
        smoothed towards the prior with prior_weight pseudo-observations."""
        w = self.config.prior_weight
        accepted = sum(a for _, a in state.rounds)
        rejected = sum(1 for k, a in state.rounds if a < k)
        return (accepted + self.prior() * w) / (accepted + rejected + w)

    def prior(self) -> float:
        """What a request without history is assumed to be accepted at: the per-token
        acceptance of the last ``pool_window`` rounds of every request, smoothed towards
        ``prior_acceptance`` with ``prior_weight`` pseudo-observations (a fixed 0.7 overrated a
        head accepted about half the time on every new request)."""
        cfg = self.config
        return (self._pool_accepted + cfg.prior_acceptance * cfg.prior_weight) / (
            self._pool_accepted + self._pool_rejected + cfg.prior_weight
        )

    def _best_k(self, acceptance: float, cap: int, batch_size: int) -> int:
        """The best k for a request drafting alone at ``batch_size`` (may it pay at all?);
        memoised until the costs change (asked for many requests a step)."""
        if self._memo_version != self.costs.version:
            self._memo.clear()
            self._memo_version = self.costs.version
        key = (round(acceptance, 3), cap, batch_size)
        k = self._memo.get(key)
        if k is None:
            k = self._memo[key] = StepPrice(self, batch_size).grant([acceptance], [cap])[0]
        return k

    def update(self, state: RequestSpecState, proposed: int, accepted: int) -> None:
        """Record one verified round of ``proposed`` drafted tokens, ``accepted`` of them kept."""
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted ({accepted}) must be in [0, proposed={proposed}]")
        cfg = self.config
        state.proposed += proposed
        state.accepted += accepted
        state.verify_steps += 1
        state.rounds.append((proposed, accepted))
        while len(state.rounds) > cfg.window:
            state.rounds.popleft()
        rejected = int(accepted < proposed)
        self._pool.append((accepted, rejected))
        self._pool_accepted, self._pool_rejected = self._pool_accepted + accepted, self._pool_rejected + rejected
        if len(self._pool) > cfg.pool_window:
            a, r = self._pool.popleft()
            self._pool_accepted, self._pool_rejected = self._pool_accepted - a, self._pool_rejected - r
        if state.off_steps is not None:  # this was a probe
            if accepted == 0:
                state.off_steps = 0
                state.probes += 1
                return
            state.off_steps = None
            state.probes = 0
            state.zero_streak = 0
            state.cap = 1  # start again gently; acceptance raises it
            return
        state.zero_streak = state.zero_streak + 1 if accepted == 0 else 0
        if state.zero_streak >= cfg.off_after and not self.priced():
            state.off_steps = 0
            state.rounds.clear()
            return
        rate = state.acceptance_rate
        assert rate is not None
        if rate > cfg.raise_above:
            state.cap = min(state.cap + 1, state.limit)
        elif rate < cfg.lower_below:
            state.cap = max(state.cap - 1, 1)


class StepPrice:
    """The drafts of one step's requests, granted together. With n requests decoding, j of
    them drafting (the likeliest to be accepted) up to D tokens each (their caps permitting),
    the verify pass is n + their drafts long and D draft steps run for j sequences; the
    (j, D) with the most expected tokens per second is chosen (fewer drafted tokens unless
    clearly better), or nothing unless it beats ``margin`` times plain's. Priced one request
    at a time, as if each drafted alone, no single request could pay at batch 4 where four
    sharing the draft steps do (a head drafting k = 2 for all four: 1.72 tokens per forward,
    the adaptive policy 1.11 at the same speed), and the sizes priced were never the step's."""

    def __init__(self, policy: SpeculationPolicy, batch_size: int, probes: int = 0) -> None:
        self.costs, self.margin = policy.costs, policy.config.margin
        self.n, self.probes = max(batch_size, 1), probes  # probes: requests drafting 1 token whatever it costs
        self.plain = self.costs.target_time(self.n)

    def grant(self, acceptances: Sequence[float], caps: Sequence[int]) -> list[int]:
        """k for each request (its acceptance estimate, its cap); the caps while no plain step
        is measured (acceptance alone decides). Draft steps not measured yet are taken as free
        (drafting is how they get measured), within the trusted sizes: taken as a reason to
        draft every cap, they had 63 of 63 new requests draft 4 tokens at batch 63."""
        if self.plain is None:
            return list(caps)
        order = sorted(range(len(caps)), key=lambda i: -acceptances[i])
        best, best_rate = (0, 0), self.margin * self.n / self.plain
        trusted = self.costs.trusted_size()
        drafts = [self.costs.draft_time(j + self.probes) or 0.0 for j in range(1, len(caps) + 1)]  # 0: not timed yet
        for depth in range(1, max(caps, default=0) + 1):
            tokens, gain, pick, pick_rate = self.n + self.probes, float(self.n), 0, 0.0  # (probes' gain not counted)
            for j, i in enumerate(order, 1):
                k = min(caps[i], depth)
                tokens += k
                if tokens > trusted:
                    break
                gain += expected_tokens(acceptances[i], k) - 1
                verify = self.costs.target_time(tokens)
                assert verify is not None
                rate = gain / (verify + depth * drafts[j - 1])
                if rate > pick_rate:
                    pick, pick_rate = j, rate
            if pick_rate > best_rate * (1.02 if best[0] else 1.0):  # more drafts only when clearly better
                best, best_rate = (pick, depth), pick_rate
        chosen = set(order[: best[0]])
        return [min(caps[i], best[1]) if i in chosen else 0 for i in range(len(caps))]
