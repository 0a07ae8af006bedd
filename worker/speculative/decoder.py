"""The SpecDecoder: speculative decoding from proposal to rollback, and all its state.

The engine asks it four things per step (docs/engine.md, "Speculative decoding"):

1. **plan** (while scheduling): ``lookahead(req, batch_size)`` — how many draft positions a
   decoding request gets, from the policy's k for it (within its max_tokens and the context)
   and what the proposer can offer;
2. **propose**: the proposer drafts that many tokens for each such request (retried request by
   request when the batch fails);
3. **verify**: after the target's forward pass over ``[last token, drafts...]``, exact
   rejection sampling against the target's distributions picks the tokens;
4. **accept and roll back**: the request's computed tokens move past the accepted prefix, the
   target's blocks for rejected positions go back, the proposer keeps only the accepted
   prefix of its own state, and the policy learns from the round.

It owns every piece of speculation state: each request's policy state and counters
(``RequestSpecState``), the drafts of the current step, the proposer (with its own per-request
state) and the cost model. :class:`~draftwise.worker.engine.request.Request` holds none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from draftwise.worker.engine.config import EngineConfig
from draftwise.worker.engine.continuation import add_spec_counters
from draftwise.worker.engine.outputs import RequestDelta, SpecStats
from draftwise.worker.engine.request import Request
from draftwise.worker.model.loader import LoadedModel, load_model
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.paths import default_model_path
from draftwise.worker.sampling.sampler import SamplingRow, TokenLogprobs, processed_probs, token_logprobs
from draftwise.worker.speculative.draft import DraftModelProposer
from draftwise.worker.speculative.ngram import NgramProposer
from draftwise.worker.speculative.policy import CostModel, PolicyConfig, RequestSpecState, SpeculationPolicy
from draftwise.worker.speculative.proposer import Proposer
from draftwise.worker.speculative.rejection_sampler import rejection_sample

if TYPE_CHECKING:
    from draftwise.worker.engine.block_manager import BlockManager
    from draftwise.worker.engine.scheduler import ScheduledRequest

log = structlog.get_logger("draftwise.spec")

Emit = Callable[[Request, list[int], list[TokenLogprobs | None]], RequestDelta | None]
"""Append tokens to a request and report them (the engine's output path); None if it failed."""
Fail = Callable[[Request, BaseException], None]
"""Finish a request because of an error of its own."""
IsFatal = Callable[[BaseException], bool]
"""Whether an error poisons the whole step (then it is raised, never contained)."""


MAX_INLINE_BACKLOG = 2
"""A proposal reads at most this many unread tokens of a request itself (steady decoding: the
target's last token, or the last draft and the bonus token of a fully accepted round); a
request further behind is caught up first, through the token budget (:meth:`SpecDecoder.catch_up`)."""


def load_draft(config: EngineConfig, target: LoadedModel, max_model_len: int) -> LoadedModel | None:
    """The draft model when ``config`` speculates with one (checked against the target)."""
    if config.spec_method != "draft":
        return None
    name = str(config.speculative_model)
    folder = default_model_path("draft") if name == "default" else Path(name)
    try:
        draft = load_model(folder, dtype=target.dtype, device=target.device)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_model: {e}") from e
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model's context ({draft.config.max_position_embeddings}) is shorter than "
            f"max_model_len={max_model_len}: lower max_model_len"
        )
    if draft.config.vocab_size > target.config.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft.config.vocab_size}) is larger than the target's "
            f"({target.config.vocab_size}): draft and target must share a tokenizer"
        )
    return draft


class SpecDecoder:
    """Propose → verify → accept → roll back, over the target's blocks ``blocks``."""

    def __init__(
        self,
        config: EngineConfig,
        proposer: Proposer,
        blocks: BlockManager,
        max_model_len: int,
        is_fatal: IsFatal,
    ) -> None:
        self.proposer = proposer
        self.method = proposer.name
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.is_fatal = is_fatal
        k = config.spec_k
        # n-gram lookup costs next to nothing, and its matches come and go with the text (a copy
        # resumes after an edit): a request it switched off is probed again sooner
        probe_after = 8 if self.method == "ngram" else PolicyConfig.probe_after
        self.policy = SpeculationPolicy(
            PolicyConfig(max_k=k, initial_k=min(4, k), probe_after=probe_after), CostModel()
        )
        self.adaptive = config.speculative_adaptive
        self.totals = {"proposed": 0, "accepted": 0, "verify_steps": 0, "draft_seconds": 0.0}
        self.states: dict[str, RequestSpecState] = {}  # request id -> policy state and counters
        self.drafts: dict[str, list[int]] = {}  # request id -> this step's drafted tokens
        self.doomed: list[tuple[Request, BaseException]] = []  # failed while planning; finished after
        self.behind: dict[str, Request] = {}  # request id -> request: the proposer must catch up first (this step)
        self.deferred: dict[str, int] = {}  # request id -> the k chosen while it was behind: drafted once caught up
        self._round: tuple[str, int, int] | None = None  # (request id, accepted, output length) being emitted

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        draft: LoadedModel | None,
        target_vocab: int,
        num_blocks: int,
        blocks: BlockManager,
        max_model_len: int,
        is_fatal: IsFatal,
    ) -> SpecDecoder | None:
        """The decoder ``config`` asks for (None: no speculation). A draft model's cache gets
        ``num_blocks`` blocks, as many as the target's."""
        if config.spec_method is None:
            return None
        proposer: Proposer
        if draft is not None:
            proposer = DraftModelProposer(draft, num_blocks, config.block_size, target_vocab)
        else:
            proposer = NgramProposer(config.prompt_lookup_min or 1, config.prompt_lookup_max or 4)
        return cls(config, proposer, blocks, max_model_len, is_fatal)

    # ------------------------------------------------------------------ requests

    def add(self, req: Request, cap: int | None, earlier: SpecStats | None = None) -> None:
        """Speculate for ``req`` (at most ``cap`` tokens a step; None: the policy's max), its
        counters starting from ``earlier`` (a continuation's)."""
        state = self.policy.new_state(cap)
        if earlier is not None:
            add_spec_counters(state, earlier)
        self.states[req.request_id] = state

    def stats(self, req: Request) -> SpecStats | None:
        """The request's counters so far; None when it does not speculate. While a verified
        round is being emitted, only its accepted drafts that reached the output count."""
        st = self.states.get(req.request_id)
        if st is None:
            return None
        accepted = st.accepted
        if self._round is not None and self._round[0] == req.request_id:
            _, a, before = self._round
            accepted -= a - min(a, len(req.output_token_ids) - before)
        return SpecStats(st.proposed, accepted, st.verify_steps)

    def release(self, req: Request) -> None:
        """The target's blocks of ``req`` were freed (finished, aborted, failed, preempted):
        its drafts and the proposer's state go too; its counters stay until :meth:`forget`."""
        self.drafts.pop(req.request_id, None)
        self.deferred.pop(req.request_id, None)
        self.proposer.release(req)

    def forget(self, req: Request) -> None:
        """``req``'s final output is built: drop its state."""
        self.release(req)
        self.states.pop(req.request_id, None)

    def draft_tokens(self, req: Request) -> list[int]:
        """This step's drafts of ``req`` (the target verifies them after its last token)."""
        return self.drafts.get(req.request_id, [])

    # ------------------------------------------------------------------ plan

    def lookahead(self, num_running: int) -> Callable[[Request, int], int] | None:
        """The scheduler's ``lookahead`` for this step; None when drafting cannot pay at this
        batch size (the per-request decisions are skipped) or when the policy wants a plain
        step timed."""
        self.behind = {}
        if not self.policy.may_pay(num_running, self.adaptive):
            return None
        if self.adaptive and self.policy.measure_plain(num_running):
            return None  # a plain step, timed: what speculation is weighed against
        return self._lookahead

    def _lookahead(self, req: Request, batch_size: int) -> int:
        """Draft positions ``req`` (decoding) gets this step: the policy's k within what is left
        of its max_tokens and the context, and what the proposer can offer. An error of the
        request's own is kept in ``doomed`` (the engine finishes it after scheduling)."""
        self.drafts.pop(req.request_id, None)
        st = self.states.get(req.request_id)
        if st is None or st.limit == 0:
            return 0
        try:
            if not self.proposer.can_draft(req):
                st.cap = st.limit = 0  # tokens the proposer cannot read: not speculated any more
                self.proposer.release(req)
                return 0
            room = min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens)
            k = self.deferred.pop(req.request_id, None)  # decided while catching up: the policy is not asked twice
            if k is None:
                k = self.policy.choose_k(st, batch_size) if self.adaptive else st.limit
            k = min(k, room)
            if k > 0 and self.proposer.backlog(req) > MAX_INLINE_BACKLOG:
                self.behind[req.request_id] = req  # no drafts until the proposer has caught up
                self.deferred[req.request_id] = k
                return 0
            return self.proposer.plan(req, k) if k > 0 else 0
        except Exception as e:
            if self.is_fatal(e):
                raise
            self.doomed.append((req, e))
            return 0

    # ------------------------------------------------------------------ catch up

    def catch_up(self, budget: int, fail: Fail) -> None:
        """Let the proposer read the unread tokens of the requests it lags behind (``behind``,
        oldest first), at most ``budget`` tokens in all: what the step's token budget has left
        after the target's tokens and the drafts. The rest waits for the next steps; meanwhile
        those requests decode plainly. When the batch fails, each request catches up alone and
        those that still fail are finished."""
        reqs, ns = [], []
        for r in self.behind.values():
            if budget <= 0:
                break
            if r.is_finished:
                continue
            n = min(self.proposer.backlog(r), budget)
            if n > 0:
                reqs.append(r)
                ns.append(n)
                budget -= n
        self.behind = {}
        if not reqs:
            return
        try:
            self.proposer.catch_up(reqs, ns)
            return
        except Exception as e:
            if self.is_fatal(e):
                raise
            log.warning("catch-up failed for the batch; isolating", error=repr(e), requests=len(reqs))
        for r, n in zip(reqs, ns, strict=True):
            self.proposer.release(r)  # whatever the failed batch left behind: start over from nothing
            try:
                self.proposer.catch_up([r], [n])
            except Exception as e:
                if self.is_fatal(e):
                    raise
                fail(r, e)

    # ------------------------------------------------------------------ propose

    def propose(self, spec: list[ScheduledRequest], fail: Fail) -> dict[str, torch.Tensor | None]:
        """Drafts for the requests verifying this step; per request id its q ([k, vocab]) or
        None (q one-hot at the drafts). When the batch fails, each request proposes alone from
        a clean state, and those that still fail are finished with their error."""
        try:
            return self._propose(spec)
        except Exception as e:
            if self.is_fatal(e):
                raise
            log.warning("proposal failed for the batch; isolating", error=repr(e), requests=len(spec))
        out: dict[str, torch.Tensor | None] = {}
        for s in spec:
            self.proposer.release(s.request)  # whatever the failed batch left behind
            try:
                out.update(self._propose([s]))
            except Exception as e:
                if self.is_fatal(e):
                    raise
                fail(s.request, e)
        return out

    def _propose(self, spec: list[ScheduledRequest]) -> dict[str, torch.Tensor | None]:
        ks = [s.num_draft_tokens for s in spec]
        prop = self.proposer.propose([s.request for s in spec], ks)
        for s, d in zip(spec, prop.token_ids, strict=True):
            self.drafts[s.request.request_id] = d
        if prop.step_seconds is not None:
            self.policy.costs.record_draft(prop.step_batch, prop.step_seconds)
        self.totals["draft_seconds"] += prop.seconds
        qs = [None] * len(spec) if prop.probs is None else list(prop.probs.split(ks))
        return {s.request.request_id: q for s, q in zip(spec, qs, strict=True)}

    # ------------------------------------------------------------------ verify, accept, roll back

    def verify(
        self,
        logits: torch.Tensor,  # [sum of num_logits, vocab]
        verify: list[tuple[ScheduledRequest, int]],  # (request, its first logits row)
        draft_q: dict[str, torch.Tensor | None],
        emit: Emit,
        fail: Fail,
    ) -> tuple[int, int]:
        """Rejection-sample the drafts against the target's distributions, emit the tokens and
        roll back what was rejected; returns (drafts verified, accepted). When the batch fails,
        each request is verified alone and those that still fail are finished."""
        try:
            results = self._verify_batch(logits, verify, draft_q)
        except Exception as e:
            if self.is_fatal(e):
                raise
            log.warning("verification failed for the batch; isolating", error=repr(e), requests=len(verify))
            results = []
            for item in verify:
                try:
                    results.extend(self._verify_batch(logits, [item], draft_q))
                except Exception as e1:
                    if self.is_fatal(e1):
                        raise
                    fail(item[0].request, e1)
        proposed = accepted = 0
        for s, toks, a, lps in results:
            r, k = s.request, s.num_draft_tokens
            try:
                reached = self._accept(r, k, a, toks, lps, emit)
            except Exception as e:
                if self.is_fatal(e):
                    raise
                fail(r, e)
                continue
            proposed += k
            accepted += reached
        self.totals["proposed"] += proposed
        self.totals["accepted"] += accepted
        self.totals["verify_steps"] += len(results)
        return proposed, accepted

    def _accept(self, r: Request, k: int, a: int, toks: list[int], lps: list[TokenLogprobs | None], emit: Emit) -> int:
        """Emit the round's tokens and roll back; returns the accepted drafts that reached the
        output (fewer than ``a`` when the request finished inside the accepted run: a stop
        token, a stop string, max_tokens). The policy learns from ``a``, the draft's real
        agreement; the request's counters count only what reached the output."""
        st = self.states[r.request_id]
        self.policy.update(st, k, a)
        num_tokens_before = r.num_tokens
        r.num_computed_tokens += 1 + a  # the token verified plus the accepted drafts; the last emitted one is new
        self.drafts.pop(r.request_id, None)
        self._round = (r.request_id, a, len(r.output_token_ids))  # stats() counts what is emitted
        try:
            delta = emit(r, toks, lps)
        finally:
            self._round = None
        if delta is None:  # the request failed on its own: its counters no longer matter
            return 0
        reached = min(a, len(delta.token_ids))
        st.accepted -= a - reached
        if not delta.finished:
            self.blocks.shrink(r.block_table, r.num_tokens)  # rejected positions' blocks go back
            self.proposer.settle(r, num_tokens_before, k, a)
        return reached

    def _verify_batch(
        self,
        logits: torch.Tensor,  # [sum of num_logits, vocab]
        verify: list[tuple[ScheduledRequest, int]],
        draft_q: dict[str, torch.Tensor | None],
    ) -> list[tuple[ScheduledRequest, list[int], int, list[TokenLogprobs | None]]]:
        """(request, tokens, accepted, logprobs) for each of ``verify``; touches no request."""
        idx: list[int] = []
        rows: list[SamplingRow] = []
        drafts = [self.drafts[s.request.request_id] for s, _ in verify]
        for (s, first), d in zip(verify, drafts, strict=True):
            r, k = s.request, s.num_draft_tokens
            idx.extend(range(first, first + k + 1))
            rows.extend(r.sampling_row(d[:j]) for j in range(k + 1))
        v_logits = logits[torch.tensor(idx, device=logits.device)]  # [sum(k + 1), vocab]
        p = processed_probs(v_logits, rows)  # [sum(k + 1), vocab]
        reqs = [s.request for s, _ in verify]
        res = rejection_sample(
            p,
            drafts,
            _stack_q([draft_q.get(r.request_id) for r in reqs], drafts, p),
            [r.sampling_params.is_greedy for r in reqs],
            [r.seed for r in reqs],
            [r.num_tokens for r in reqs],  # the position of each request's first draft
            [r.sampling_params.seed is not None for r in reqs],  # seeded: Gumbel coupling, output as plain sampling
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
                    torch.tensor(toks, device=p.device),
                )
            base += k + 1
            out.append((s, toks, a, lps))
        return out

    # ------------------------------------------------------------------ checks

    def check(self, reqs: Sequence[Request]) -> None:
        """Speculation state only for unfinished requests; the proposer's consistent."""
        ids = {r.request_id for r in reqs}
        stray = (set(self.states) | set(self.drafts) | set(self.deferred)) - ids
        if stray:
            raise AssertionError(f"speculation state kept for requests that are gone: {sorted(stray)}")
        self.proposer.check(reqs)

    def check_idle(self) -> None:
        left = set(self.states) | set(self.drafts) | set(self.deferred)
        if left:
            raise AssertionError(f"speculation state left: {sorted(left)}")
        self.proposer.check_idle()


def _stack_q(
    qs: list[torch.Tensor | None],
    drafts: list[list[int]],
    p: torch.Tensor,  # [sum(k + 1), vocab]: the target's distributions (for shape, dtype, device)
) -> torch.Tensor | None:  # [sum k, vocab]
    """One q tensor for the verifier from per-request draft distributions: None when no
    request has one (the verifier then takes q one-hot at each draft), else the rows stacked,
    one-hot at the drafted token where a request has none (n-gram drafts; greedy rows, whose
    q the verifier does not read)."""
    if all(q is None for q in qs):
        return None
    parts = []
    for q, d in zip(qs, drafts, strict=True):
        if q is None:
            q = torch.zeros(len(d), p.shape[1], dtype=p.dtype, device=p.device)
            q[torch.arange(len(d), device=p.device), torch.tensor(d, device=p.device, dtype=torch.long)] = 1.0
        parts.append(q.to(p.dtype))
    return torch.cat(parts)


__all__ = ["SpecDecoder", "load_draft"]
