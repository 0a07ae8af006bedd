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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    max_k = max(ks)
    target_start = [0] * num_reqs  # row of request i's first position in target_probs
    draft_start = [0] * num_reqs  # row of request i's first position in draft_probs
    for i in range(1, num_reqs):
        target_start[i] = target_start[i - 1] + ks[i - 1] + 1
        draft_start[i] = draft_start[i - 1] + ks[i - 1]

    # ---- acceptance test, vectorised over all draft positions of the batch
    num_accepted_t = torch.zeros(num_reqs, dtype=torch.int64, device=device)  # [num_reqs]
    if max_k > 0:
        flat_ids = torch.tensor([int(t) for ids in draft_token_ids for t in ids], dtype=torch.int64, device=device)
        t_rows = torch.tensor(
            [target_start[i] + j for i in range(num_reqs) for j in range(ks[i])], dtype=torch.int64, device=device
        )  # [sum(k_i)]: the target row scoring each draft token
        p_x = target_probs[t_rows, flat_ids]  # [sum(k_i)]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)  # [sum(k_i)]: q one-hot at the drafted token
        else:
            q_x = draft_probs[torch.arange(len(flat_ids), device=device), flat_ids].to(p_x.dtype)  # [sum(k_i)]
        # One uniform in [0, 1) per draft position, per request from its own generator.
        # u < p/q is exact at the edges: p == q -> ratio 1 (always accepted), q == 0 < p -> inf
        # (accepted), p == 0 -> 0 or NaN (always rejected; comparisons with NaN are False).
        uniforms = torch.zeros_like(p_x)  # [sum(k_i)]
        for i in range(num_reqs):
            if ks[i] > 0 and not greedy[i]:
                start = draft_start[i]
                uniforms[start : start + ks[i]] = torch.rand(
                    ks[i], generator=generators[i], device=device, dtype=p_x.dtype
                )
        accept = uniforms < p_x / q_x  # [sum(k_i)]
        greedy_pos = [draft_start[i] + j for i in range(num_reqs) if greedy[i] for j in range(ks[i])]
        if greedy_pos:  # greedy rows: accept iff the draft is the argmax
            gp = torch.tensor(greedy_pos, dtype=torch.int64, device=device)  # [num_greedy_pos]
            accept[gp] = flat_ids[gp] == target_probs[t_rows[gp]].argmax(dim=-1)
        # Scatter into [num_reqs, max_k] (padding counts as rejected); accepted = length of the
        # leading run of accepts.
        req_of_pos = torch.tensor([i for i in range(num_reqs) for _ in range(ks[i])], dtype=torch.int64, device=device)
        col_of_pos = torch.tensor([j for i in range(num_reqs) for j in range(ks[i])], dtype=torch.int64, device=device)
        grid = torch.zeros((num_reqs, max_k), dtype=torch.int64, device=device)  # [num_reqs, max_k]
        grid[req_of_pos, col_of_pos] = accept.to(torch.int64)
        num_accepted_t = grid.cumprod(dim=1).sum(dim=1)  # [num_reqs]
    num_accepted = [int(n) for n in num_accepted_t.tolist()]

    # ---- the one final token per request: recovered (first rejection) or bonus
    final_rows = torch.tensor(
        [target_start[i] + num_accepted[i] for i in range(num_reqs)], dtype=torch.int64, device=device
    )  # [num_reqs]
    p_final = target_probs[final_rows]  # [num_reqs, vocab]
    weights = p_final.clone()  # [num_reqs, vocab], unnormalised: the race below does not need a sum of 1
    rejected = [num_accepted[i] < ks[i] and not greedy[i] for i in range(num_reqs)]
    rej_idx = [i for i in range(num_reqs) if rejected[i]]
    if rej_idx:
        rej_t = torch.tensor(rej_idx, dtype=torch.int64, device=device)  # [num_rej]
        if draft_probs is None:
            rej_tok = torch.tensor([int(draft_token_ids[i][num_accepted[i]]) for i in rej_idx], device=device)
            residual = weights[rej_t].scatter(1, rej_tok.unsqueeze(1), 0.0)  # [num_rej, vocab]: p without x
        else:
            q_rows = torch.tensor([draft_start[i] + num_accepted[i] for i in rej_idx], device=device)
            residual = (weights[rej_t] - draft_probs[q_rows].to(weights.dtype)).clamp_min(0.0)  # [num_rej, vocab]
        has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [num_rej, 1]
        weights[rej_t] = torch.where(has_mass, residual, weights[rej_t])

    # Exponential race as in the Sampler: argmax(w / E), E ~ Exp(1) i.i.d., picks i with
    # probability w_i / sum(w). Greedy rows draw nothing and take argmax p.
    noise = torch.ones_like(weights)  # [num_reqs, vocab]
    for i in range(num_reqs):
        if not greedy[i]:
            noise[i].exponential_(generator=generators[i])
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # Exp(1) can be exactly 0; 0/0 would win as NaN
    final_t = (weights / noise).argmax(dim=-1)  # [num_reqs]
    greedy_idx = [i for i in range(num_reqs) if greedy[i]]
    if greedy_idx:
        gi = torch.tensor(greedy_idx, dtype=torch.int64, device=device)  # [num_greedy]
        final_t[gi] = p_final[gi].argmax(dim=-1)
    final = final_t.tolist()  # [num_reqs]

    token_ids = [[int(t) for t in draft_token_ids[i][: num_accepted[i]]] + [int(final[i])] for i in range(num_reqs)]
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)
