"""How many tokens to speculate, per request per step (docs/engine.md, "Speculative decoding").

Two layers:

1. **Acceptance**: each request keeps the per-token acceptance of its recent rounds (the
   chance that a drafted token is accepted given the ones before it were). Its cap on k rises
   by one while acceptance is above ``raise_above``, falls by one below ``lower_below``; after
   ``off_after`` rounds in a row with nothing accepted speculation goes off for the request,
   and after ``probe_after`` plain steps it is probed again with k = 1.
2. **Cost**: the engine records how long draft steps and verify steps take at each batch
   size (``CostModel``). Given an acceptance rate a, k drafted tokens yield on average
   (1 - a^(k+1)) / (1 - a) tokens per step; the policy picks the k (zero included) up to the
   request's cap that gives the most tokens per second of step time at the current batch
   size, so speculation switches itself down where batches are large enough that it no
   longer pays. A request for which the costs chose k = 0 for ``probe_after`` steps in a row
   speculates once with k = 1, so that its acceptance estimate (and the costs) stay current
   — unless even perfect acceptance would not pay at the current batch size (then a probe
   could only cost: a large batch verifying twice its tokens, the draft catching up).

The acceptance estimate is smoothed towards ``prior_acceptance`` with ``prior_weight``
pseudo-observations, so that one unlucky round does not decide a request's fate.
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
    window: int = 8  # rounds of history behind the acceptance estimate
    prior_acceptance: float = 0.7  # acceptance assumed before a request has any history
    prior_weight: float = 4.0  # pseudo-observations of prior_acceptance mixed into the estimate

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


@dataclass
class RequestSpecState:
    """One request's speculation history."""

    cap: int  # the most tokens this request may draft now
    limit: int  # the most it may ever draft (the policy's max_k, or less if the request asks)
    rounds: deque[tuple[int, int]] = field(default_factory=deque)  # recent (proposed, accepted)
    zero_streak: int = 0  # rounds in a row with nothing accepted
    off_steps: int | None = None  # plain steps since speculation went off (None: on)
    idle_steps: int = 0  # steps in a row for which the costs chose k = 0
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
    """Measured step times by batch size: an exponentially weighted mean per size,
    interpolated between measured sizes."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._verify: dict[int, float] = {}  # tokens in the target's forward -> seconds
        self._draft: dict[int, float] = {}  # sequences in one draft step -> seconds
        self._keys: dict[int, list[int]] = {id(self._verify): [], id(self._draft): []}  # sorted keys per table
        self.version = 0  # bumped on every record: the policy's cached decisions go stale

    def record_target(self, num_tokens: int, seconds: float) -> None:
        self._update(self._verify, num_tokens, seconds)

    def record_draft(self, num_seqs: int, seconds: float) -> None:
        self._update(self._draft, num_seqs, seconds)

    def _update(self, table: dict[int, float], key: int, seconds: float) -> None:
        old = table.get(key)
        if old is None:
            bisect.insort(self._keys[id(table)], key)
        table[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self.version += 1

    def _lookup(self, table: dict[int, float], key: int) -> float | None:
        """The measured time at ``key``; between two measured sizes, linear interpolation;
        outside them, scaled in proportion from the nearest one."""
        if not table:
            return None
        got = table.get(key)
        if got is not None:
            return got
        keys = self._keys[id(table)]
        i = bisect.bisect_left(keys, key)
        below = keys[i - 1] if i > 0 else None
        above = keys[i] if i < len(keys) else None
        if below is not None and above is not None:
            w = (key - below) / (above - below)
            return (1 - w) * table[below] + w * table[above]
        nearest = below if above is None else above
        assert nearest is not None
        return table[nearest] * key / nearest

    def target_time(self, num_tokens: int) -> float | None:
        return self._lookup(self._verify, num_tokens)

    def draft_time(self, num_seqs: int) -> float | None:
        return self._lookup(self._draft, num_seqs)


class SpeculationPolicy:
    def __init__(self, config: PolicyConfig | None = None, costs: CostModel | None = None) -> None:
        self.config = config or PolicyConfig()
        self.costs = costs or CostModel()
        self._memo: dict[tuple[float, int, int], int] = {}
        self._memo_version = -1

    def new_state(self, cap: int | None = None) -> RequestSpecState:
        """State for a new request; ``cap`` is its own limit on k (from its SamplingParams)."""
        limit = self.config.max_k if cap is None else max(0, min(cap, self.config.max_k))
        return RequestSpecState(cap=min(self.config.initial_k, limit), limit=limit)

    def choose_k(self, state: RequestSpecState, batch_size: int) -> int:
        """Tokens to draft for this request this step (0: a plain decode step)."""
        if state.cap == 0:
            return 0
        if state.off_steps is not None:
            if state.off_steps < self.config.probe_after:
                state.off_steps += 1
                return 0
            return 1  # probe
        k = self._best_k(self.estimate(state), state.cap, batch_size)
        if k > 0:
            state.idle_steps = 0
            return k
        if self._best_k(1.0, state.cap, batch_size) == 0:
            return 0  # not even perfect acceptance would pay at this batch size: nothing to probe
        state.idle_steps += 1
        if state.idle_steps > self.config.probe_after:
            state.idle_steps = 0
            return 1  # re-measure: acceptance and costs move
        return 0

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
        plain = self.costs.target_time(batch_size)
        draft = self.costs.draft_time(batch_size)
        if plain is None or draft is None:
            return cap  # nothing measured yet: acceptance alone decides
        best_k, best_rate = 0, 1.0 / plain
        for k in range(1, cap + 1):
            verify = self.costs.target_time(batch_size * (k + 1))
            assert verify is not None
            rate = expected_tokens(acceptance, k) / (verify + k * draft)
            if rate > best_rate * 1.02:  # prefer fewer drafted tokens unless clearly better
                best_k, best_rate = k, rate
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
                return
            state.off_steps = None
            state.zero_streak = 0
            state.cap = 1  # start again gently; acceptance raises it
            return
        state.zero_streak = state.zero_streak + 1 if accepted == 0 else 0
        if state.zero_streak >= cfg.off_after:
            state.off_steps = 0
            state.rounds.clear()
            return
        rate = state.acceptance_rate
        assert rate is not None
        if rate > cfg.raise_above:
            state.cap = min(state.cap + 1, state.limit)
        elif rate < cfg.lower_below:
            state.cap = max(state.cap - 1, 1)
