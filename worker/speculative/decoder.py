"""The SpecDecoder: speculative decoding from proposal to rollback, and all its state.

The engine's step asks it, phase by phase, and gets data back (docs/engine.md, "Speculative
decoding"); nothing in it calls back into the engine:

1. **plan** (before scheduling): :meth:`SpecDecoder.plan` — how many draft positions each
   decoding request wants (the policy's k within its max_tokens and the context, and what the
   proposer can offer), which requests the proposer must catch up first, and which failed;
2. **catch up / propose** (after scheduling): the proposer reads what it lags behind within the
   token budget left, then drafts the granted positions (:meth:`catch_up`, :meth:`propose`);
3. **verify**: after the target's forward pass over ``[last token, drafts...]``, exact rejection
   sampling against the target's distributions picks the tokens (:meth:`verify` returns them);
4. **settle**: once the output processor has kept what it keeps, the policy learns from the
   round, the counters count what reached the output, and the proposer keeps only the accepted
   prefix of its own state (:meth:`settle`). The request's progress and blocks are the
   scheduler's (``Scheduler.update_from_output``).

Per request it keeps one record (:class:`SpecRequest`: the policy's state and counters, this
step's drafts and their draft distributions, a k deferred while catching up); the proposer
keeps its own per-request state. :class:`~draftwise.worker.core.request.Request` holds none
of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import torch

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.core.containment import Failure, contain, contain_each, is_step_fatal
from draftwise.worker.core.outputs import SpecStats
from draftwise.worker.core.request import Request
from draftwise.worker.model.loader import LoadedModel
from draftwise.worker.sampling.sampler import (
    SamplingRow,
    TokenLogprobs,
    greedy_tokens,
    processed_probs,
    token_logprobs,
)
from draftwise.worker.speculative.cross_draft import CROSS_POOL_SCALE, CrossVocabProposer
from draftwise.worker.speculative.draft import DraftModelProposer
from draftwise.worker.speculative.heads import LoadedHead
from draftwise.worker.speculative.hidden import EagleProposer, MedusaProposer
from draftwise.worker.speculative.hybrid import HybridProposer
from draftwise.worker.speculative.ngram import LookupProposer, NgramProposer
from draftwise.worker.speculative.policy import CostModel, PolicyConfig, RequestSpecState, SpeculationPolicy
from draftwise.worker.speculative.proposer import Observed, Proposer, stack_draft_probs
from draftwise.worker.speculative.rejection_sampler import accept_greedy, rejection_sample
from draftwise.worker.speculative.suffix import DEFAULT_MAX_TOKENS, SuffixProposer
from draftwise.worker.speculative.vocab_bridge import VocabBridge

if TYPE_CHECKING:
    from draftwise.worker.core.scheduler import ScheduledRequest

log = structlog.get_logger("draftwise.spec")


@dataclass
class SpecRequest:
    """One request's speculation: the policy's state and counters, and this step's drafts."""

    policy: RequestSpecState
    drafts: list[int] = field(default_factory=list)  # this step's drafted tokens (verified after its last token)
    q: torch.Tensor | None = None  # [len(drafts), vocab]: their draft distributions; None: one-hot
    deferred_k: int | None = None  # the k chosen while the proposer was behind: drafted once caught up


@dataclass
class SpecPlan:
    """What speculation wants of this step, decided before scheduling."""

    draft_k: dict[str, int] = field(default_factory=dict)  # request id -> draft positions wanted (>= 1)
    behind: list[Request] = field(default_factory=list)  # the proposer must catch up first: no drafts yet
    failed: list[Failure] = field(default_factory=list)  # planning failed for these requests


@dataclass(frozen=True)
class Verified:
    """One request's verified round: the tokens to append (accepted drafts, then the target's
    own token), and what the round was."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    num_drafts: int  # k: drafts verified
    num_accepted: int  # of which accepted (the draft's real agreement)
    num_tokens_before: int  # the request's length before the round


MAX_INLINE_BACKLOG = Proposer.inline_backlog
"""A draft model's proposal reads at most this many unread tokens of a request itself (steady decoding: the
target's last token, or the last draft and the bonus token of a fully accepted round); a
request further behind is caught up first, through the token budget (:meth:`SpecDecoder.catch_up`)."""


class SpecDecoder:
    """Plan → catch up → propose → verify → settle; all speculation state."""

    def __init__(self, config: EngineConfig, proposer: Proposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.method = proposer.name
        self.max_model_len = max_model_len
        k = config.spec_k
        # n-gram lookup costs next to nothing, and its matches come and go with the text (a copy
        # resumes after an edit): a request it switched off is probed again sooner
        lookup = any(m in ("ngram", "suffix") for m in self.method.split("+"))
        probe_after = 8 if lookup else PolicyConfig.probe_after
        policy_config = PolicyConfig(max_k=k, initial_k=min(4, k), probe_after=probe_after)
        self.policy = SpeculationPolicy(policy_config, CostModel(forget_after=1024, min_samples=2))
        self.adaptive = config.speculative_adaptive
        self.totals = {"proposed": 0, "accepted": 0, "verify_steps": 0, "draft_seconds": 0.0}
        self.requests: dict[str, SpecRequest] = {}  # request id -> its speculation record

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        draft: LoadedModel | LoadedHead | None,
        target: LoadedModel,
        num_blocks: int,
        max_model_len: int,
        bridge: VocabBridge | None = None,
    ) -> SpecDecoder | None:
        """The decoder ``config`` asks for (None: no speculation). A draft model's cache, and
        an EAGLE head's, gets ``num_blocks`` blocks, as many as the target's (a draft with
        another tokenizer, read through ``bridge``: CROSS_POOL_SCALE times as many)."""
        if config.spec_method is None:
            return None
        proposer: Proposer
        vocab = target.config.vocab_size
        if isinstance(draft, LoadedHead):
            if draft.config.kind == "eagle":
                proposer = EagleProposer(draft, target.model, vocab, num_blocks, config.block_size)
            else:
                proposer = MedusaProposer(draft, target.model, vocab)
        elif config.spec_method == "suffix":
            proposer = _lookup(config, "suffix")
        elif draft is not None and bridge is not None:
            proposer = CrossVocabProposer(draft, CROSS_POOL_SCALE * num_blocks, config.block_size, bridge)
            proposer.runner.decode_threads = config.decode_threads
        elif draft is not None:
            proposer = DraftModelProposer(draft, num_blocks, config.block_size, vocab, config.enable_prefix_caching)
            proposer.runner.decode_threads = config.decode_threads  # (its steps are small too)
        else:
            proposer = _lookup(config, "ngram")
        if config.speculative_lookup is not None:
            proposer = HybridProposer(proposer, _lookup(config, config.speculative_lookup))
        decoder = cls(config, proposer, max_model_len)
        if isinstance(proposer, HybridProposer):
            proposer.costs = decoder.policy.costs  # the parts are weighed with the step times the policy measures
        return decoder

    # ------------------------------------------------------------------ requests

    def serves(self, methods: Sequence[str] | None) -> bool:
        """Whether a request that may draft with ``methods`` (None: any) speculates here: one of
        them is this proposer or a part of its hybrid (the hybrid keeps to the named parts)."""
        return methods is None or any(m in self.method.split("+") for m in methods)

    def add(self, req: Request, cap: int | None, earlier: SpecStats | None = None) -> None:
        """Speculate for ``req`` (at most ``cap`` tokens a step; None: the policy's max), its
        counters starting from ``earlier`` (a continuation's)."""
        state = self.policy.new_state(cap)
        if earlier is not None:  # reported cumulatively; the policy's acceptance window starts afresh
            state.proposed += earlier.proposed
            state.accepted += earlier.accepted
            state.verify_steps += earlier.verify_steps
        self.requests[req.request_id] = SpecRequest(state)

    def stats(self, req: Request) -> SpecStats | None:
        """The request's counters so far; None when it does not speculate."""
        sr = self.requests.get(req.request_id)
        if sr is None:
            return None
        st = sr.policy
        return SpecStats(st.proposed, st.accepted, st.verify_steps)

    def release(self, req: Request) -> None:
        """The target's blocks of ``req`` were freed (finished, aborted, failed, preempted):
        its drafts and the proposer's state go too; its counters stay until :meth:`forget`."""
        sr = self.requests.get(req.request_id)
        if sr is not None:
            sr.drafts, sr.q, sr.deferred_k = [], None, None
        self.proposer.release(req)

    def forget(self, req: Request) -> None:
        """``req``'s final output is built: drop its state."""
        self.release(req)
        self.requests.pop(req.request_id, None)

    @property
    def wants_hidden(self) -> bool:
        """Whether the proposer reads the target's hidden states (:meth:`observe`)."""
        return self.proposer.wants_hidden

    def observe(self, scheduled: Sequence[ScheduledRequest], hidden: torch.Tensor) -> None:
        """After the target's forward pass over ``scheduled`` (before their progress is
        updated): hand the proposer each speculating request's new tokens and their rows of
        ``hidden`` ([sum of new tokens, hidden], in the pass's order). A request whose
        observation fails only stops speculating (its proposer state is released)."""
        items, at = [], 0
        for s in scheduled:
            r, n = s.request, s.num_new_tokens
            if r.request_id in self.requests and not r.is_finished:
                start = r.num_computed_tokens
                toks = (
                    r.token_slice(start, start + 1) + self.draft_tokens(r)
                    if s.num_draft_tokens
                    else r.token_slice(start, start + n)
                )
                items.append(Observed(r, start, toks, hidden[at : at + n], s.num_draft_tokens))
            at += n
        try:
            self.proposer.observe(items)
        except Exception as e:
            if is_step_fatal(e):
                raise
            for it in items:
                try:
                    self.proposer.observe([it])
                except Exception as e1:
                    if is_step_fatal(e1):
                        raise
                    log.warning(
                        "hidden-state observation failed; the request stops speculating",
                        request_id=it.request.request_id,
                        error=repr(e1),
                    )
                    self.proposer.release(it.request)

    def draft_tokens(self, req: Request) -> list[int]:
        """This step's drafts of ``req`` (the target verifies them after its last token)."""
        return sr.drafts if (sr := self.requests.get(req.request_id)) is not None else []

    # ------------------------------------------------------------------ plan

    def plan(self, running: Sequence[Request]) -> SpecPlan:
        """Before scheduling: the draft positions each decoding request of ``running`` wants
        (none where drafting cannot pay at this batch size, or a plain step is to be timed)."""
        plan = SpecPlan()
        n = len(running)
        if not self.policy.may_pay(n, self.adaptive) or (self.adaptive and self.policy.measure_plain(n)):
            return plan
        self.proposer.start_step(n)
        decoding = []
        for req in running:
            sr = self.requests.get(req.request_id)
            if sr is not None and req.num_uncomputed_tokens == 1:
                sr.drafts, sr.q = [], None
                if sr.policy.limit > 0:
                    decoding.append(req)
        asked = {}  # the policy's k of each request not catching up, decided together (none for a fixed k)
        if self.adaptive:
            ask = [r for r in decoding if self.requests[r.request_id].deferred_k is None]
            ks = self.policy.choose_ks([self.requests[r.request_id].policy for r in ask], n, list(map(self._room, ask)))
            asked = {r.request_id: k for r, k in zip(ask, ks, strict=True)}
        done, plan.failed = contain_each(
            decoding, lambda r: self._plan_one(r, self.requests[r.request_id], asked.get(r.request_id)), _self
        )
        for req, (k, behind) in done:
            if behind:
                plan.behind.append(req)
            if k > 0:
                plan.draft_k[req.request_id] = k
        return plan

    def _room(self, req: Request) -> int:  # the most it may draft: what is left of its max_tokens and the context
        return min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens)

    def _plan_one(self, req: Request, sr: SpecRequest, asked: int | None) -> tuple[int, bool]:
        """Draft positions ``req`` wants: the policy's k (``asked``; with a fixed k its limit) within its room and
        what the proposer offers; and whether the proposer catches up on it first (a hybrid's lookup may draft)."""
        st = sr.policy
        if not self.proposer.can_draft(req):
            st.cap = st.limit = 0  # tokens the proposer cannot read: not speculated any more
            self.proposer.release(req)
            return 0, False
        room = self._room(req)
        k, sr.deferred_k = sr.deferred_k, None  # decided while catching up: the policy is not asked twice
        if k is None:
            k = asked if asked is not None else st.limit
        k = max(0, min(k, room))
        behind = k > 0 and self.proposer.backlog(req) > self.proposer.inline_backlog
        m = self.proposer.offer(req, k, max(k, min(st.limit, room)), behind)
        if behind and m == 0:
            sr.deferred_k = k  # no drafts until the proposer has caught up, which it does now
            return 0, True
        return m, False  # drafts that need no catching up (a hybrid's lookup) leave the catch-up for later

    # ------------------------------------------------------------------ catch up

    def catch_up(self, behind: Sequence[Request], budget: int) -> list[Failure]:
        """Let the proposer read the unread tokens of the requests it lags behind (oldest
        first), at most ``budget`` tokens in all: what the step's token budget has left after
        the target's tokens and the drafts. The rest waits for the next steps; meanwhile those
        requests decode plainly."""
        work: list[tuple[Request, int]] = []
        for r in behind:
            if budget <= 0:
                break
            n = min(self.proposer.backlog(r), budget)
            if n > 0:
                work.append((r, n))
                budget -= n

        def run(items: Sequence[tuple[Request, int]]) -> list[None]:
            self.proposer.catch_up([r for r, _ in items], [n for _, n in items])
            return [None] * len(items)

        _, failed = contain(work, run, lambda w: w[0], "catch-up", reset=lambda w: self.proposer.reset(w[0]))
        return failed

    # ------------------------------------------------------------------ propose

    def propose(self, verifying: Sequence[ScheduledRequest]) -> list[Failure]:
        """Drafts for the requests verifying this step, kept in their records (with q, the
        draft distributions, or None: one-hot at the drafts)."""
        done, failed = contain(
            verifying, self._propose, lambda s: s.request, "proposal", reset=lambda s: self.proposer.reset(s.request)
        )
        for s, (drafts, q) in done:
            sr = self.requests[s.request.request_id]
            sr.drafts, sr.q = drafts, q
        return failed

    def _propose(self, spec: Sequence[ScheduledRequest]) -> list[tuple[list[int], torch.Tensor | None]]:
        ks = [s.num_draft_tokens for s in spec]
        prop = self.proposer.propose([s.request for s in spec], ks)
        if prop.step_seconds is not None:
            self.policy.costs.record_draft(prop.step_batch, prop.step_seconds)
        self.totals["draft_seconds"] += prop.seconds
        qs: list[torch.Tensor | None] = [None] * len(spec) if prop.probs is None else list(prop.probs.split(ks))
        return list(zip(prop.token_ids, qs, strict=True))

    # ------------------------------------------------------------------ verify, settle

    def verify(
        self,
        logits: torch.Tensor,  # [sum of num_logits, vocab]
        verify: Sequence[tuple[ScheduledRequest, int]],  # (request, its first logits row)
    ) -> tuple[list[Verified], list[Failure]]:
        """Rejection-sample the drafts against the target's distributions: the tokens each
        request gets. Touches no request."""
        done, failed = contain(
            verify, lambda items: self._verify_batch(logits, items), lambda v: v[0].request, "verification"
        )
        return [v for _, v in done], failed

    def settle(self, v: Verified, kept: int, finished: bool) -> int:
        """After the output processor kept ``kept`` of the round's tokens: the policy learns
        from the draft's real agreement, the request's counters count only the accepted drafts
        that reached the output (fewer when it finished inside the accepted run: a stop token, a
        stop string, max_tokens), and the proposer keeps the accepted prefix. Returns those
        accepted drafts that reached the output."""
        r, k, a = v.request, v.num_drafts, v.num_accepted
        sr = self.requests[r.request_id]
        self.policy.update(sr.policy, k, a)
        reached = min(a, kept)
        sr.policy.accepted -= a - reached
        sr.drafts, sr.q = [], None
        if not finished:
            self.proposer.settle(r, v.num_tokens_before, k, a)
        self.totals["proposed"] += k
        self.totals["accepted"] += reached
        self.totals["verify_steps"] += 1
        return reached

    def record_target_step(self, num_tokens: int, seconds: float) -> None:
        """A pure decode/verify step's cost (forward, sampling or verification, outputs), for
        the policy's cost model; the proposer's share is recorded when it proposes."""
        self.policy.costs.record_target(num_tokens, seconds)

    def _verify_batch(
        self,
        logits: torch.Tensor,  # [sum of num_logits, vocab]
        verify: Sequence[tuple[ScheduledRequest, int]],
    ) -> list[Verified]:
        idx: list[int] = []
        rows: list[SamplingRow] = []
        recs = [self.requests[s.request.request_id] for s, _ in verify]
        drafts = [sr.drafts for sr in recs]
        for (s, first), d in zip(verify, drafts, strict=True):
            r, k = s.request, s.num_draft_tokens
            idx.extend(range(first, first + k + 1))
            rows.extend(r.sampling_row(d[:j]) for j in range(k + 1))
        v_logits = logits[torch.tensor(idx, device=logits.device)]  # [sum(k + 1), vocab]
        reqs = [s.request for s, _ in verify]
        if all(r.sampling_params.is_greedy for r in reqs):  # the sampler's own greedy choice; no distributions
            res = accept_greedy(greedy_tokens(v_logits, rows).tolist(), drafts)
        else:
            p = processed_probs(v_logits, rows)  # [sum(k + 1), vocab]
            res = rejection_sample(
                p,
                drafts,
                _as(stack_draft_probs([sr.q for sr in recs], drafts), p),
                [r.sampling_params.is_greedy for r in reqs],
                [r.seed for r in reqs],
                [r.num_tokens for r in reqs],  # the position of each request's first draft
                [r.sampling_params.seed is not None for r in reqs],  # seeded: Gumbel coupling, as plain sampling
            )
        out = []
        base = 0
        for (s, _), toks, a in zip(verify, res.token_ids, res.num_accepted, strict=True):
            r, k = s.request, s.num_draft_tokens
            lps: list[TokenLogprobs | None] = [None] * len(toks)
            if r.sampling_params.logprobs is not None:
                lps = token_logprobs(
                    v_logits[base : base + len(toks)],
                    rows[base : base + len(toks)],
                    torch.tensor(toks, device=v_logits.device),
                )
            base += k + 1
            out.append(Verified(r, toks, lps, k, a, r.num_tokens))
        return out

    # ------------------------------------------------------------------ checks

    def check(self, reqs: Sequence[Request]) -> None:
        """Speculation state only for unfinished requests; the proposer's consistent."""
        stray = set(self.requests) - {r.request_id for r in reqs}
        if stray:
            raise AssertionError(f"speculation state kept for requests that are gone: {sorted(stray)}")
        self.proposer.check(reqs)

    def check_idle(self) -> None:
        if self.requests:
            raise AssertionError(f"speculation state left: {sorted(self.requests)}")
        self.proposer.check_idle()


def _lookup(config: EngineConfig, method: str) -> LookupProposer:
    if method == "suffix":
        return SuffixProposer(config.suffix_cache_max_tokens or DEFAULT_MAX_TOKENS)
    return NgramProposer(config.prompt_lookup_min or 1, config.prompt_lookup_max or 4)


def _self(r: Request) -> Request:
    return r


def _as(q: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor | None:
    return None if q is None else q.to(p.dtype)


__all__ = ["SpecDecoder"]
