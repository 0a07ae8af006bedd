"""A model drafter and a lookup side by side: per request and step, the one that promises more
(docs/engine.md, "Speculative decoding", hybrid).

A draft model (or an EAGLE head, or Medusa heads) drafts well on text it can predict; a lookup (the suffix cache
over earlier outputs, or n-gram prompt lookup) drafts nothing most of the time, and long runs
that are almost always accepted when the answer repeats something seen before (code edits,
tool-call JSON, templated answers), at no model cost. :class:`HybridProposer` runs both
through the one :class:`~draftwise.worker.speculative.proposer.Proposer` interface:

- **Planning**: the lookup looks up every decoding request (it costs next to nothing and is
  spent anyway); when it finds ``m`` drafts, the request's two options are compared by the
  step's expected tokens per second, ``(n - 1 + expected_tokens(a, m)) / (verify(n + m) + m * c)``
  for a batch of ``n``, with ``a`` the option's per-token acceptance on this request (its own
  window of recent rounds, smoothed towards the part's acceptance over all requests' recent
  rounds), ``verify`` the target's measured step time at the batch's size plus the drafts (the
  speculation policy's :class:`~draftwise.worker.speculative.policy.CostModel`), and ``c`` the
  drafter's measured cost per drafted token (0 for the lookup). The model's ``m`` is the k the
  policy chose. The better offer drafts only if it beats plain decoding's ``n / plain(n)``.
- **Catching up**: after a round of lookup drafts the draft model lags the request by the
  accepted tokens. While the lookup keeps finding drafts it keeps drafting, and the draft model
  catches up only in a step where the lookup finds nothing (through the step's token budget,
  the request decoding plainly meanwhile, as with a draft model alone): one pass over the whole
  lag instead of one per round.
- **k**: the policy's k (priced at the model's draft cost) is what the model drafts; the
  lookup, which costs nothing to draft, looks up to the request's ceiling (its limit, its
  max_tokens and the context), and drafts even where the policy chose k = 0, when its expected
  rate beats plain decoding.
- **Settling**: the part that drafted keeps its accepted prefix; a hidden-state part (EAGLE,
  Medusa) settles after every verify pass, whoever drafted, since it observed the pass's
  features: EAGLE keeps the accepted positions' features after those its layer has not read
  yet, and reads them all, like a draft model, once the lookup finds nothing.
  A draft model that did not draft this step read nothing past the request's real tokens: it
  has nothing to roll back.

Exactness holds whatever is chosen: the choice depends only on the request's past, and the
verifier takes each request's draft distribution (q one-hot for lookup drafts), so rejection
sampling and the seeded coupling apply unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftwise.worker.speculative.ngram import LookupProposer
from draftwise.worker.speculative.policy import CostModel, expected_tokens
from draftwise.worker.speculative.proposer import Observed, Proposal, Proposer, stack_draft_probs

if TYPE_CHECKING:
    from torch import Tensor

    from draftwise.worker.core.request import Request

__all__ = ["HybridProposer", "Window"]

MODEL, LOOKUP = 0, 1
"""The two parts, as the per-request records index them."""
WINDOW = 16  # rounds of each part behind a request's acceptance estimate
PRIOR = 0.7  # acceptance assumed before a part has drafted at all
PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior in an estimate
GLOBAL_WINDOW = 256  # rounds of each part, all requests, behind the prior of a request's estimate
UNMEASURED_DRAFT_COST = 0.1  # a model-drafted token's cost in target steps, until one is measured


class Window:
    """A part's last ``size`` verified rounds (drafted, accepted), with their totals kept as
    rounds come and go: an estimate costs O(1), not a sum over the window, for every request
    at every step."""

    def __init__(self, size: int) -> None:
        self.rounds: deque[tuple[int, int]] = deque()
        self.size = size
        self.accepted = 0
        self.rejected = 0  # rounds that ended in a rejection (fewer accepted than drafted)

    def add(self, drafted: int, accepted: int) -> None:
        if len(self.rounds) == self.size:
            k, a = self.rounds.popleft()
            self.accepted -= a
            self.rejected -= a < k
        self.rounds.append((drafted, accepted))
        self.accepted += accepted
        self.rejected += accepted < drafted

    def estimate(self, prior: float) -> float:
        """Per-token acceptance, accepted / (accepted + rejections), with PRIOR_WEIGHT
        pseudo-observations of ``prior``."""
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


@dataclass
class _Choice:
    """One request's record: each part's recent rounds, how often each drafted, and this
    step's choice."""

    rounds: tuple[Window, Window] = field(default_factory=lambda: (Window(WINDOW), Window(WINDOW)))
    chosen: int | None = None  # the part drafting this step (None: neither)
    model_off: bool = False  # the model cannot read this request's tokens, or the request named the lookup only
    lookup_off: bool = False  # the request named the model only


class HybridProposer(Proposer):
    """A model drafter (draft model, EAGLE or Medusa) and a lookup (suffix or n-gram): per request and
    step the more promising one drafts (see the module docstring)."""

    def __init__(self, model: Proposer, lookup: LookupProposer, costs: CostModel | None = None) -> None:
        if isinstance(model, LookupProposer):
            raise ValueError(
                f"a hybrid pairs a draft model, an EAGLE head or Medusa heads with a lookup, not {model.name!r}"
            )
        self.model = model
        self.lookup = lookup
        self.costs = costs or CostModel()
        self.name = f"{model.name}+{lookup.name}"
        self.inline_backlog = model.inline_backlog
        self.wants_hidden = model.wants_hidden
        self.choices: dict[str, _Choice] = {}
        self.drafted = [0, 0]  # verified rounds each part drafted (model, lookup), for reports and tests
        self.recent = (Window(GLOBAL_WINDOW), Window(GLOBAL_WINDOW))  # each part's rounds, all requests
        self._batch_size = 1
        self._model_cost: float | None = None  # seconds of one more model-drafted token (fastest recent)
        self._model_costs: deque[float] = deque(maxlen=9)

    @property
    def parts(self) -> tuple[Proposer, ...]:
        return (self.model, self.lookup)

    def _choice(self, req: Request) -> _Choice:
        c = self.choices.get(req.request_id)
        if c is None:  # the request's speculative_methods keep it to the parts it names
            names = req.sampling_params.speculative_methods
            c = self.choices[req.request_id] = _Choice()
            c.model_off = names is not None and self.model.name not in names
            c.lookup_off = names is not None and self.lookup.name not in names
        return c

    # ------------------------------------------------------------------ reading

    def observe(self, items: Sequence[Observed]) -> None:
        if self.model.wants_hidden:
            self.model.observe(items)

    def can_draft(self, req: Request) -> bool:
        """The lookup reads any token; a request the model cannot read is drafted by the
        lookup alone from now on."""
        c = self._choice(req)
        if not c.model_off and not self.model.can_draft(req):
            c.model_off = True
            self.model.release(req)
        return True

    def backlog(self, req: Request) -> int:
        return 0 if self._choice(req).model_off else self.model.backlog(req)

    def catch_up(self, reqs: Sequence[Request], ns: Sequence[int]) -> None:
        self.model.catch_up(reqs, ns)

    # ------------------------------------------------------------------ planning

    def start_step(self, batch_size: int) -> None:
        self._batch_size = max(1, batch_size)

    def estimate(self, req: Request, part: int) -> float:
        """The part's per-token acceptance on ``req`` (accepted / (accepted + rejections)
        over its window), smoothed towards the part's acceptance over all requests' recent
        rounds (itself smoothed towards PRIOR): a new request starts from what the part
        does on this worker's traffic, not from a guess."""
        return self._choice(req).rounds[part].estimate(self.recent[part].estimate(PRIOR))

    def rate(self, req: Request, part: int, m: int) -> tuple[float, bool]:
        """Expected tokens per second of this step if ``part`` drafts ``m`` tokens for ``req``
        (the batch's other requests yield one token each either way; the model's drafts add
        their draft steps, which the whole batch waits for), and whether it rests on measured
        times (else it is in plain-step units, a model-drafted token taken as
        UNMEASURED_DRAFT_COST of a step)."""
        n = self._batch_size
        verify = self.costs.target_time(n + m)
        unit = self._model_cost if part == MODEL else 0.0
        measured = verify is not None and unit is not None
        if verify is None or unit is None:
            verify, unit = 1.0, UNMEASURED_DRAFT_COST if part == MODEL else 0.0
        return (n - 1 + expected_tokens(self.estimate(req, part), m)) / (verify + m * unit), measured

    def plan(self, req: Request, k: int) -> int:
        return self.offer(req, k, k, behind=False)

    def offer(self, req: Request, k: int, ceiling: int, behind: bool) -> int:
        """The lookup looks up to ``ceiling`` (it costs nothing to draft, so the policy's k,
        priced at the model's cost, does not cap it); the model offers ``k`` unless it is
        behind; the better rate wins, if it beats plain decoding (once the times are measured)."""
        c = self._choice(req)
        m_lookup = self.lookup.plan(req, ceiling) if ceiling > 0 and not c.lookup_off else 0
        m_model = 0 if c.model_off or behind or k == 0 else self.model.plan(req, k)
        offers = [(*self.rate(req, part, m), part, m) for part, m in ((LOOKUP, m_lookup), (MODEL, m_model)) if m]
        # on equal rates the lookup wins (LOOKUP > MODEL): it costs no drafting
        rate, measured, part, m = max(offers, key=lambda o: (o[0], o[2]), default=(0.0, False, MODEL, 0))
        plain = self.costs.target_time(self._batch_size)
        beats = not measured or plain is None or rate > self._batch_size / plain
        c.chosen = part if m and beats else None
        if m_lookup and c.chosen != LOOKUP:
            self.lookup.discard(req)
        return 0 if c.chosen is None else m

    # ------------------------------------------------------------------ proposing

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        t0 = time.perf_counter()
        groups: tuple[list[int], list[int]] = ([], [])
        for i, r in enumerate(reqs):
            chosen = self._choice(r).chosen
            if chosen is None:
                raise RuntimeError(f"hybrid proposer: {r.request_id} was granted drafts but planned none")
            groups[chosen].append(i)
        drafts: list[list[int]] = [[] for _ in reqs]
        q_parts: list[Tensor | None] = [None] * len(reqs)
        step_seconds, step_batch = None, 0
        for part, idx in enumerate(groups):
            if not idx:
                continue
            proposer = self.parts[part]
            prop = proposer.propose([reqs[i] for i in idx], [ks[i] for i in idx])
            qs = [None] * len(idx) if prop.probs is None else list(prop.probs.split([ks[i] for i in idx]))
            for i, d, q in zip(idx, prop.token_ids, qs, strict=True):
                drafts[i], q_parts[i] = d, q
            if part == MODEL and prop.step_seconds is not None:
                step_seconds, step_batch = prop.step_seconds, prop.step_batch
                self._model_costs.append(prop.step_seconds)
                self._model_cost = min(self._model_costs)
        probs = stack_draft_probs(q_parts, drafts)
        # the policy's cost model hears only of model drafting: a lookup's near-zero cost kept
        # as its fastest recent time would make model drafts look free
        return Proposal(drafts, probs, time.perf_counter() - t0, step_seconds, max(step_batch, 1))

    # ------------------------------------------------------------------ after verification

    def settle(self, req: Request, num_tokens_before: int, k: int, accepted: int) -> None:
        c = self._choice(req)
        chosen, c.chosen = c.chosen, None
        if chosen is not None:
            c.rounds[chosen].add(k, accepted)
            self.recent[chosen].add(k, accepted)
            self.drafted[chosen] += 1
        if chosen == MODEL or (self.model.wants_hidden and not c.model_off):
            self.model.settle(req, num_tokens_before, k, accepted)
        if chosen == LOOKUP:
            self.lookup.settle(req, num_tokens_before, k, accepted)

    def reset(self, req: Request) -> None:
        chosen = self._choice(req).chosen
        if chosen is not None:
            self.parts[chosen].reset(req)

    def release(self, req: Request) -> None:
        self.model.release(req)
        self.lookup.release(req)
        self.choices.pop(req.request_id, None)

    def check(self, reqs: Sequence[Request]) -> None:
        stray = set(self.choices) - {r.request_id for r in reqs}
        if stray:
            raise AssertionError(f"hybrid records kept for requests that are gone: {sorted(stray)}")
        self.model.check(reqs)
        self.lookup.check(reqs)

    def check_idle(self) -> None:
        self.check([])
        self.model.check_idle()
        self.lookup.check_idle()
