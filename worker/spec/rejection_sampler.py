"""Exact speculative-decoding rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

A proposer drafts ``k_i`` tokens ``x_1..x_k`` for request ``i``; the target scores all
``k_i + 1`` positions in one forward pass. Position ``j`` (0-based) then has a target
distribution ``p_j`` and, for proposers that have one, a draft distribution ``q_j`` under
which ``x_{j+1}`` was drawn. The tokens kept are distributed exactly as if the target alone
had sampled them one at a time:

- **sampling rows**: accept ``x`` with probability ``min(1, p(x) / q(x))``; on the first
  rejection draw the *recovered* token from ``normalize(max(0, p - q))`` and stop; if all
  ``k_i`` are accepted draw a *bonus* token from ``p_k`` (the last position).
- **greedy rows**: accept while the draft token equals ``argmax p``; then emit ``argmax p``
  (at the first mismatch, or at the bonus position). The RNG is not touched.

Edge cases follow from the rule and are handled exactly: ``q(x) = 0 < p(x)`` accepts (infinite
ratio), ``p(x) = 0`` always rejects (also when ``q(x) = 0``), ``p == q`` always accepts,
and a residual ``max(0, p - q)`` with no mass (only possible when ``p <= q`` everywhere,
i.e. ``p == q`` up to rounding, or for a malformed draft) falls back to ``p``. Proposers
without a distribution (n-gram prompt lookup) pass ``draft_probs=None``: ``q`` is then
one-hot at the drafted token, so ``x`` is accepted with probability ``p(x)`` and the
recovered token is drawn from ``p`` with ``x`` removed.

**p and q must be shaped identically.** Both must come from
:func:`draftwise.worker.sampler.processed_probs` with the same ``SamplingParams`` (and, for
penalties and ``min_tokens``, the same output tokens up to each position), so that
temperature, top-k, top-p, min-p, penalties and masks act on the draft exactly as on the
target. The guarantee is "distributed as the target's *processed* distribution".

**Randomness** is per request, from the request's own ``torch.Generator`` (on the probs'
device), always in the same amount and order: ``k_i`` uniforms (one per draft position,
whether or not it is reached), then one Exp(1) variate per vocabulary entry for the final
token (recovered or bonus), drawn as :class:`~draftwise.worker.sampler.Sampler` draws them.
A seeded request therefore produces the same tokens whatever else shares its batch, and
with ``k_i = 0`` it draws exactly the token the plain sampler would.

The accept-and-resample step itself runs on padded tensors through the dispatch point
(``dispatch.impl("rejection_accept", device)``): a Triton kernel on CUDA, its torch twin
:func:`draftwise.kernels.reference.rejection_accept` elsewhere. This module draws the
randomness and pads the batch; an all-greedy batch takes a shortcut that needs neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.kernels import dispatch

__all__ = ["RejectionOutput", "rejection_sample"]


@dataclass(frozen=True)
class RejectionOutput:
    """Per request, in request order, the tokens a verify step produced."""

    token_ids: list[list[int]]
    """The accepted draft tokens followed by exactly one more token (recovered on the first
    rejection, bonus if all k_i were accepted); length num_accepted + 1."""
    num_accepted: list[int]
    """How many of the request's k_i draft tokens were accepted, in [0, k_i]."""


def _check_inputs(
    target_probs: torch.Tensor,  # [sum(k_i + 1), vocab]
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,  # [sum(k_i), vocab]
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Validate shapes and per-request arguments; return each request's k_i."""
    num_reqs = len(draft_token_ids)
    if len(greedy) != num_reqs or len(generators) != num_reqs:
        raise ValueError(
            f"draft_token_ids, greedy and generators must have one entry per request, "
            f"got {num_reqs}, {len(greedy)} and {len(generators)}"
        )
    ks = [len(d) for d in draft_token_ids]
    num_target = sum(ks) + num_reqs
    if target_probs.dim() != 2 or target_probs.shape[0] != num_target:
        raise ValueError(f"target_probs must be [sum(k_i + 1)={num_target}, vocab], got {list(target_probs.shape)}")
    if not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be floating point, got {target_probs.dtype}")
    vocab = target_probs.shape[1]
    if draft_probs is not None:
        if draft_probs.dim() != 2 or tuple(draft_probs.shape) != (sum(ks), vocab):
            raise ValueError(f"draft_probs must be [sum(k_i)={sum(ks)}, vocab={vocab}], got {list(draft_probs.shape)}")
        if draft_probs.device != target_probs.device:
            raise ValueError(f"draft_probs is on {draft_probs.device}, target_probs on {target_probs.device}")
    for i, (ids, g, gen) in enumerate(zip(draft_token_ids, greedy, generators, strict=True)):
        for t in ids:
            if not 0 <= int(t) < vocab:
                raise ValueError(f"request {i}: draft token id {t} is outside the vocabulary [0, {vocab})")
        if not g and gen is None:
            raise ValueError(f"request {i} samples (greedy=False) but has no generator")
    return ks


def _greedy(target_probs: torch.Tensor, draft_token_ids: Sequence[Sequence[int]], ks: list[int]) -> RejectionOutput:
    """All rows greedy: one argmax over the batch, then accept while the drafts match it."""
    best = target_probs.argmax(dim=-1).tolist()  # [sum(k_i + 1)]
    token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    row = 0
    for ids, k in zip(draft_token_ids, ks, strict=True):
        a = 0
        while a < k and int(ids[a]) == best[row + a]:
            a += 1
        token_ids.append([int(t) for t in ids[:a]] + [best[row + a]])
        num_accepted.append(a)
        row += k + 1
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)


@torch.no_grad()
def rejection_sample(
    target_probs: torch.Tensor,  # [sum(k_i + 1), vocab] float32: p at each draft position + bonus, request after request
    draft_token_ids: Sequence[Sequence[int]],  # per request, k_i ids
    draft_probs: torch.Tensor | None,  # [sum(k_i), vocab] float32 q; None: one-hot at the drafted token
    greedy: Sequence[bool],  # per request
    generators: Sequence[torch.Generator | None],  # per request; None only for greedy rows
) -> RejectionOutput:
    """Verify a batch of drafts against the target's distributions; see the module docstring.

    ``target_probs`` holds, for request after request, the ``k_i + 1`` target distributions
    at the positions of its ``k_i`` draft tokens and the bonus position; ``draft_probs`` the
    ``k_i`` draft distributions in the same order. Requests with ``k_i = 0`` draw one token
    from their single ``p``. Raises ``ValueError`` on inconsistent shapes, out-of-vocabulary
    draft ids or a sampling request without a generator. Pure: nothing is modified except
    the sampling requests' generators, which advance by a fixed amount.
    """
    ks = _check_inputs(target_probs, draft_token_ids, draft_probs, greedy, generators)
    num_reqs = len(ks)
    if num_reqs == 0:
        return RejectionOutput(token_ids=[], num_accepted=[])
    if all(greedy):
        return _greedy(target_probs, draft_token_ids, ks)
    device = target_probs.device
    dtype = target_probs.dtype
    vocab = target_probs.shape[1]
    max_k = max(ks)

    # ---- padded tensors for the accept-and-resample op: [N, K + 1, V] p, [N, K, V] q, ...
    if all(k == max_k for k in ks):  # every request drafted K tokens: a view, no copy
        p_pad = target_probs.reshape(num_reqs, max_k + 1, vocab).contiguous()  # [N, K + 1, V]
        q_pad = None if draft_probs is None else draft_probs.reshape(num_reqs, max_k, vocab).contiguous()
    else:
        p_pad = target_probs.new_zeros(num_reqs, max_k + 1, vocab)  # [N, K + 1, V]
        p_req = torch.tensor([i for i in range(num_reqs) for _ in range(ks[i] + 1)], device=device)
        p_pos = torch.tensor([j for i in range(num_reqs) for j in range(ks[i] + 1)], device=device)
        p_pad[p_req, p_pos] = target_probs
        q_pad = None
        if draft_probs is not None:
            q_pad = draft_probs.new_zeros(num_reqs, max_k, vocab)  # [N, K, V]
            q_req = torch.tensor([i for i in range(num_reqs) for _ in range(ks[i])], device=device)
            q_pos = torch.tensor([j for i in range(num_reqs) for j in range(ks[i])], device=device)
            q_pad[q_req, q_pos] = draft_probs
    if q_pad is not None and q_pad.dtype != dtype:
        q_pad = q_pad.to(dtype)
    ids_pad = torch.tensor(
        [[int(t) for t in ids] + [0] * (max_k - len(ids)) for ids in draft_token_ids], dtype=torch.int64, device=device
    ).view(num_reqs, max_k)  # [N, K]
    num_draft = torch.tensor(ks, dtype=torch.int64, device=device)  # [N]
    greedy_t = torch.tensor([bool(g) for g in greedy], dtype=torch.bool, device=device)  # [N]

    # ---- randomness, per request from its own generator, in the documented order and amount:
    # k_i uniforms in [0, 1), then one Exp(1) variate per vocabulary entry; greedy rows draw nothing.
    uniforms = torch.zeros(num_reqs, max_k, dtype=dtype, device=device)  # [N, K]
    for i in range(num_reqs):
        if ks[i] > 0 and not greedy[i]:
            uniforms[i, : ks[i]] = torch.rand(ks[i], generator=generators[i], device=device, dtype=dtype)
    noise = torch.ones(num_reqs, vocab, dtype=dtype, device=device)  # [N, V]
    for i in range(num_reqs):
        if not greedy[i]:
            noise[i].exponential_(generator=generators[i])

    accept_fn = dispatch.impl("rejection_accept", device)
    num_accepted_t, final_t = accept_fn(p_pad, q_pad, ids_pad, num_draft, uniforms, noise, greedy_t)  # [N], [N]
    num_accepted, final = torch.stack([num_accepted_t, final_t]).tolist()  # one host sync

    token_ids = [[int(t) for t in draft_token_ids[i][: num_accepted[i]]] + [int(final[i])] for i in range(num_reqs)]
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)
