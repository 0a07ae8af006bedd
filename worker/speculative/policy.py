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
   (1 - a^(k+1)) / (1 - a) tokens per step; the policy picks the k (zero included) up to the
   request's cap that gives the step the most tokens per second at the current batch size
   (counting this request's drafts at the margin: its k more tokens in the forward pass and
   its k draft steps), so speculation switches itself down where batches are large enough that it no
   longer pays. A request for which the costs chose k = 0 for ``probe_after`` steps in a row
   speculates once with k = 1, so that its acceptance estimate (and the costs) stay current
   — unless even perfect acceptance would not pay at the current batch size (then a probe
   could only cost: a large batch verifying twice its tokens, the draft catching up).

The acceptance estimate is smoothed towards ``prior_acceptance`` with ``prior_weight``
pseudo-observations, so that one unlucky round does not decide a request's fate. Drafting is
chosen only when it promises ``margin`` times plain's tokens per second. The plain step's
cost is what everything is weighed against, so ``measure_plain`` asks the engine for a timed
plain step while it is unknown at the current batch size, and now and then after that (see
``CostModel`` for how times are kept and extrapolated).
(What requests report, accepted over proposed, is a different number: it falls with k.)
"""

from __future__ import annotations

import bisect
from collections import deque
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
    prior_weight: float = 2.0  # pseudo-observations of prior_acceptance mixed into the estimate
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
        if self.off_after < 1 or self.probe_after < 1 or self.window < 1:
            raise ValueError("off_after, probe_after and window must be >= 1")
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
    * **Sizes not measured**: between two measured sizes, linear interpolation; outside
      them, an affine fit ``a + b * size`` over all measured sizes (least squares, ``a >= 0``,
      ``b >= 0``) anchored at the nearest one. Time is never assumed proportional to size: a
      forward pass over a few tokens costs about what one token costs (it reads the same
      weights). With a single measured size there is no slope yet and the time is taken as
      flat (the next speculating step measures a second size); below the smallest measured
      size it is never less than proportional scaling would give.
    """

    def __init__(self, window: int = 9, forget_after: int = 256) -> None:
        if window < 1 or forget_after < 1:
            raise ValueError(f"window and forget_after must be >= 1, got {window}, {forget_after}")
        self.window = window
        self.forget_after = forget_after
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
        times = {k: min(t for v, t in d if v > oldest) for k, d in table.items() if any(v > oldest for v, _ in d)}
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

    def choose_k(self, state: RequestSpecState, batch_size: int) -> int:
        """Tokens to draft for this request this step (0: a plain decode step)."""
        if state.cap == 0:
            return 0
        if state.off_steps is not None:
            if state.off_steps < self.probe_wait(state):
                state.off_steps += 1
                return 0
            return 1  # probe
        k = self._best_k(self.estimate(state), state.cap, batch_size)
        if k > 0:
            state.idle_steps = state.probes = 0
            return k
        if self._best_k(1.0, state.cap, batch_size) == 0:
            return 0  # not even perfect acceptance would pay at this batch size: nothing to probe
        state.idle_steps += 1
        if state.idle_steps > self.probe_wait(state):
            state.idle_steps = 0
            state.probes += 1
            return 1  # re-measure: acceptance and costs move
        return 0

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
        cfg = self.config
        accepted = sum(a for _, a in state.rounds)
        rejected = sum(1 for k, a in state.rounds if a < k)
        return (accepted + cfg.prior_acceptance * cfg.prior_weight) / (accepted + rejected + cfg.prior_weight)

    def _best_k(self, acceptance: float, cap: int, batch_size: int) -> int:
        """The k in [0, cap] with the most expected tokens per second; memoised until the
        costs change (a batch of many requests asks the same question many times a step)."""
        if self._memo_version != self.costs.version:
            self._memo.clear()
            self._memo_version = self.costs.version
        key = (round(acceptance, 3), cap, batch_size)
        k = self._memo.get(key)
        if k is None:
            k = self._memo[key] = self._compute_best_k(acceptance, cap, batch_size)
        return k

    def _compute_best_k(self, acceptance: float, cap: int, batch_size: int) -> int:
        """The request's k decided at the margin: one request drafting k tokens in a batch of
        n makes the step's forward n + k tokens long and adds k draft steps, which the whole
        batch waits for, for (1 - a^(k+1)) / (1 - a) - 1 more tokens. The step's tokens per
        second with the drafts must beat plain's n / plain(n) by ``margin``. (Pricing the draft
        steps as if this request drafted alone is pessimistic where many draft together: the
        side to err on. Assuming every request drafts the same k made speculation look as good
        at batch 4 as at batch 1, where requests of different acceptance shared the cost.)"""
        n = max(batch_size, 1)
        plain = self.costs.target_time(n)
        draft = self.costs.draft_time(1)
        if plain is None or draft is None:
            return cap  # nothing measured yet: acceptance alone decides
        best_k, best_rate = 0, 0.0
        for k in range(1, cap + 1):
            verify = self.costs.target_time(n + k)
            assert verify is not None
            rate = (n - 1 + expected_tokens(acceptance, k)) / (verify + k * draft)
            if rate > best_rate * 1.02:  # prefer fewer drafted tokens unless clearly better
                best_k, best_rate = k, rate
        if best_rate <= self.config.margin * n / plain:  # drafting must clearly beat plain decoding
            return 0
        return best_k

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
