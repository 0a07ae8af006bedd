"""What a speculative proposer is: the interface the SpecDecoder drives.

A proposer guesses the next tokens of decoding requests; the target verifies the guesses in
its own forward pass and exact rejection sampling keeps what the target would have sampled
(docs/engine.md, "Speculative decoding"). Two are built in: a draft model with its own paged
KV cache (:mod:`draftwise.worker.speculative.draft`) and n-gram prompt lookup
(:mod:`draftwise.worker.speculative.ngram`), suffix decoding over earlier outputs of the same
tenant (:mod:`draftwise.worker.speculative.suffix`), and trained EAGLE and Medusa heads that read
the target's hidden states (:mod:`draftwise.worker.speculative.hidden`).

Invariants every proposer keeps:

- **It reads, never writes, requests.** It may read a request's tokens (prompt + output),
  ``num_tokens`` and sampling parameters; the request's fields are the engine's.
- **It owns its per-request state** (draft KV blocks and how far they reach, drafts found
  while planning), keyed by request id, and frees it in :meth:`Proposer.release`, which the
  SpecDecoder calls whenever the target's blocks of a request are freed (finished, aborted,
  failed, preempted) or the request stops speculating.
- **k = 0 is not a call.** :meth:`Proposer.plan` is asked with ``k >= 1`` and may answer 0 (this
  request gets no drafts this step; the SpecDecoder asks :meth:`Proposer.offer`, which calls it only
  then, and a hybrid's lookup, which costs nothing, may offer drafts at k = 0); :meth:`Proposer.propose` only sees requests whose plan was
  ``>= 1`` and returns exactly that many tokens for each.
- **Rolling back** is :meth:`Proposer.settle`: after verification it keeps what belongs to the
  accepted prefix and forgets the rest, so that the next proposal continues from the tokens
  the request really has.
- **Catching up** is :meth:`Proposer.catch_up`: a proposer whose state lags a request's
  tokens (:meth:`Proposer.backlog`: the draft model after the prompt, a preemption or a pause)
  reads them in budgeted chunks before it drafts for it again; see the SpecDecoder.
- **Hidden states**: a proposer with ``wants_hidden`` is handed the target's final hidden
  state of every token of every forward pass (:meth:`Proposer.observe`, right after the pass,
  before verification), at no extra pass; the others never see them.
- **Failure** is an exception; the SpecDecoder then releases the requests involved and retries
  them one by one, so a proposer must come out of a failed call with every request releasable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from draftwise.worker.core.request import Request

__all__ = ["Observed", "Proposal", "Proposer", "stack_draft_probs"]


@dataclass(frozen=True)
class Observed:
    """One request's share of a target forward pass, for proposers that read hidden states."""

    request: Request
    start: int  # the position of its first new token
    token_ids: list[int]  # the new tokens (a verify pass: the last token, then the drafts)
    rows: torch.Tensor  # [len(token_ids), hidden]: their final hidden states
    num_drafts: int = 0  # a verify pass: the drafts it verified (whichever part of a hybrid drafted them)


@dataclass(frozen=True)
class Proposal:
    """Drafts for a batch of requests, in the order given."""

    token_ids: list[list[int]]  # per request, exactly the k it was planned
    probs: torch.Tensor | None  # [sum k, target vocab] float32: q at each drafted position, request after
    # request; None: the verifier takes q one-hot at each drafted token (n-gram; an all-greedy batch)
    seconds: float  # wall time spent proposing (planning included)
    step_seconds: float | None  # cost of one more drafted token for ``step_batch`` requests, for the
    # speculation policy's cost model; None: nothing representative was measured
    step_batch: int  # requests that cost covers


class Proposer(ABC):
    """Proposes draft tokens for decoding requests (see the module docstring's invariants)."""

    name: str
    """``"draft"``, ``"ngram"``, ``"eagle"``, ``"medusa"`` or ``"suffix"``: how ListModels and the logs name the method."""

    inline_backlog: int = 2
    """The most unread tokens :meth:`propose` reads itself; a request further behind is caught
    up first, through the token budget (:meth:`catch_up`)."""

    wants_hidden: bool = False
    """Whether :meth:`observe` is to be called (the engine then keeps the hidden states)."""

    def observe(self, items: Sequence[Observed]) -> None:  # noqa: B027 - proposers that read no hidden states
        """The target's forward pass computed ``items`` (per request: its new tokens and their
        final hidden states); only called when ``wants_hidden``."""

    def can_draft(self, req: Request) -> bool:  # noqa: ARG002 - proposers that read every token
        """Whether this proposer can read every token of ``req``; a request it cannot is not
        speculated any more (the SpecDecoder switches it off and releases it)."""
        return True

    @property
    def parts(self) -> tuple[Proposer, ...]:
        """The proposers this one drafts with: itself, or a hybrid's parts."""
        return (self,)

    def start_step(self, batch_size: int) -> None:  # noqa: B027 - proposers that weigh no costs
        """Planning of a step with ``batch_size`` running requests begins."""

    def offer(self, req: Request, k: int, ceiling: int, behind: bool) -> int:  # noqa: ARG002 - see HybridProposer
        """At scheduling: the drafts this proposer plans for ``req`` this step, given the
        policy's ``k`` (0: none), the most any drafts may be (``ceiling`` >= k: what the
        request's limit, its max_tokens and the context leave) and whether it must catch up
        on the request first (``behind``: then a proposal would read too much inline).
        Default: :meth:`plan` at k, nothing while behind. A hybrid's lookup, which costs
        nothing and needs no catching up, may offer up to ``ceiling`` whatever k is."""
        return 0 if k == 0 or behind else self.plan(req, k)

    def plan(self, req: Request, k: int) -> int:  # noqa: ARG002 - proposers that can always draft k
        """At scheduling: how many tokens (0..k, ``k >= 1``) this proposer will draft for ``req``
        this step; the scheduler reserves that many positions. A proposer that needs the
        drafts to know (n-gram lookup) finds them here and keeps them for :meth:`propose`."""
        return k

    @abstractmethod
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        """Draft ``ks[i] >= 1`` tokens for each of ``reqs`` (the values :meth:`plan` returned)."""

    def backlog(self, req: Request) -> int:  # noqa: ARG002 - proposers that keep no per-token state
        """Tokens of ``req`` this proposer has not read yet: 1 or 2 in steady decoding (the
        target's last token, or a fully accepted round's last draft and the bonus token); the
        whole sequence the first time, and what came since after a preemption or a pause."""
        return 0

    def catch_up(self, reqs: Sequence[Request], ns: Sequence[int]) -> None:  # noqa: B027
        """Read the next ``ns[i] >= 1`` unread tokens of each of ``reqs`` (no drafting), so that
        its backlog shrinks by that many. Only called for requests with a backlog."""

    def settle(self, req: Request, num_tokens_before: int, k: int, accepted: int) -> None:  # noqa: B027
        """After verification of ``k`` drafts of which ``accepted`` were kept, for a request
        that had ``num_tokens_before`` tokens: keep only the state of the accepted prefix."""

    def reset(self, req: Request) -> None:
        """After a batch call (catch-up, proposal) failed: undo what it left behind for
        ``req`` before the request is tried alone. Default: :meth:`release` (a draft model
        reads the tokens again); a proposer whose calls change nothing until they succeed
        keeps its state (hidden-state proposers cannot read past features again)."""
        self.release(req)

    def release(self, req: Request) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Forget everything about ``req`` and free what it held."""

    def check(self, reqs: Sequence[Request]) -> None:  # noqa: B027 - nothing to check without state
        """Raise AssertionError when the per-request state is inconsistent with ``reqs`` (the
        unfinished requests); tests call it through the engine's ``check_invariants``."""

    def check_idle(self) -> None:  # noqa: B027
        """Raise AssertionError when state is left with no request unfinished."""


def stack_draft_probs(qs: Sequence[torch.Tensor | None], drafts: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """One ``[sum k, vocab]`` tensor of draft distributions from per-request ones: None when no
    request has one (the verifier then takes q one-hot at each draft), else the rows stacked,
    one-hot at the drafted token where a request has none (lookup drafts; greedy rows, whose q
    the verifier does not read)."""
    like = next((q for q in qs if q is not None), None)
    if like is None:
        return None
    parts = []
    for q, d in zip(qs, drafts, strict=True):
        if q is None:
            q = like.new_zeros(len(d), like.shape[1])
            q[torch.arange(len(d), device=like.device), torch.tensor(list(d), dtype=torch.long, device=like.device)] = 1
        parts.append(q.to(like.dtype))
    return torch.cat(parts)
