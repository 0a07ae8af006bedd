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
  (at the first mismatch, or at the bonus position). No randomness is used.

Edge cases follow from the rule and are handled exactly: ``q(x) = 0 < p(x)`` accepts (infinite
ratio), ``p(x) = 0`` always rejects (also when ``q(x) = 0``), ``p == q`` always accepts,
and a residual ``max(0, p - q)`` with no mass (only possible when ``p <= q`` everywhere,
i.e. ``p == q`` up to rounding, or for a malformed draft) falls back to ``p``. Proposers
without a distribution (n-gram prompt lookup) pass ``draft_probs=None``: ``q`` is then
one-hot at the drafted token, so ``x`` is accepted with probability ``p(x)`` and the
recovered token is drawn from ``p`` with ``x`` removed.

**p and q must be shaped identically.** Both must come from
:func:`draftwise.worker.sampling.sampler.processed_probs` with the same ``SamplingParams`` (and, for
penalties and ``min_tokens``, the same output tokens up to each position), so that
temperature, top-k, top-p, min-p, penalties and masks act on the draft exactly as on the
target. The guarantee is "distributed as the target's *processed* distribution".

**Seeded requests** (``coupled``: the request set ``SamplingParams.seed``) are verified by
Gumbel coupling instead: the target's choice at position ``t`` is its keyed race
``argmax(p_t / E(seed, t))``, exactly the token plain sampling would pick there; a draft token
is accepted iff it equals that choice; the first mismatch, or the bonus position, emits the
target's choice. The output is then token for token the plain seeded output, whatever k, the
batch or the worker (the draft model proposes with the same ``E``, so it agrees often; any
proposer is exact). These rows take the greedy rule on the race scores ``p / E``.

**Randomness** is keyed (:mod:`draftwise.worker.sampling.keyed_random`): every number used for the
token at absolute position ``t`` of a request is a pure function of (its seed, ``t``): the
accept test's uniform ``U(seed, t)`` (stream ACCEPT), and the race noise ``E(seed, t)``
(stream SAMPLE) of the target's draw there (the recovered or bonus token of a rejection
sampling row sits at ``t = position + num_accepted``; the draft model draws its proposals for
such rows from the separate DRAFT stream, so ``x``, ``U`` and ``E`` are independent, as
exactness needs). Each position is decided once, so no number is ever reused.

The accept-and-resample step itself runs on padded tensors through the dispatch point
(``dispatch.impl("rejection_accept", device)``): a Triton kernel on CUDA, its torch twin
:func:`draftwise.kernels.reference.rejection_accept` elsewhere. With rejection-sampling rows
it runs twice: once for the number of accepted drafts (the noise is not used for that), then,
with the noise keyed at each row's final position, for the final token. This module draws the
randomness and pads the batch; a batch without rejection-sampling rows takes a shortcut that
needs neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.kernels import dispatch
from draftwise.worker.sampling.keyed_random import STREAM_ACCEPT, STREAM_SAMPLE, keyed_exponential, keyed_uniform

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
    seeds: Sequence[int | None],
    positions: Sequence[int],
    coupled: Sequence[bool],
) -> list[int]:
    """Validate shapes and per-request arguments; return each request's k_i."""
    num_reqs = len(draft_token_ids)
    if not len(greedy) == len(seeds) == len(positions) == len(coupled) == num_reqs:
        raise ValueError(
            f"draft_token_ids, greedy, seeds, positions and coupled must have one entry per request, "
            f"got {num_reqs}, {len(greedy)}, {len(seeds)}, {len(positions)} and {len(coupled)}"
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
    for i, (ids, g, seed, pos) in enumerate(zip(draft_token_ids, greedy, seeds, positions, strict=True)):
        for t in ids:
            if not 0 <= int(t) < vocab:
                raise ValueError(f"request {i}: draft token id {t} is outside the vocabulary [0, {vocab})")
        if not g and seed is None:
            raise ValueError(f"request {i} samples (greedy=False) but has no seed")
        if not 0 <= int(pos) < 2**31:
            raise ValueError(f"request {i}: position {pos} is outside [0, 2**31)")
    return ks


def accept_greedy(best: Sequence[int], draft_token_ids: Sequence[Sequence[int]]) -> RejectionOutput:
    """Greedy verification from the target's greedy token at each draft position and the bonus one (``best``:
    ``k_i + 1`` per request, request after request): accept while the drafts match, then the target's token."""
    ks = [len(ids) for ids in draft_token_ids]
    if len(best) != sum(ks) + len(ks):
        raise ValueError(f"{len(best)} greedy tokens for drafts of lengths {ks}")
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
    seeds: Sequence[int | None],  # per request; None only for greedy rows
    positions: Sequence[int],  # per request: absolute position of its first draft token (its tokens so far)
    coupled: Sequence[bool] | None = None,  # per request: verify by Gumbel coupling (seeded); None: none
) -> RejectionOutput:
    """Verify a batch of drafts against the target's distributions; see the module docstring.

    ``target_probs`` holds, for request after request, the ``k_i + 1`` target distributions
    at the positions of its ``k_i`` draft tokens and the bonus position; ``draft_probs`` the
    ``k_i`` draft distributions in the same order (not read for greedy or coupled rows).
    Requests with ``k_i = 0`` draw one token from their single ``p``, exactly the token the
    plain sampler draws at that position. Raises ``ValueError`` on inconsistent shapes,
    out-of-vocabulary draft ids, a sampling request without a seed or a position out of range.
    Pure: nothing is modified.
    """
    coupled = [False] * len(draft_token_ids) if coupled is None else coupled
    ks = _check_inputs(target_probs, draft_token_ids, draft_probs, greedy, seeds, positions, coupled)
    num_reqs = len(ks)
    if num_reqs == 0:
        return RejectionOutput(token_ids=[], num_accepted=[])
    if all(greedy):
        return accept_greedy(target_probs.argmax(dim=-1).tolist(), draft_token_ids)  # one argmax for all
    device = target_probs.device
    dtype = target_probs.dtype
    vocab = target_probs.shape[1]
    max_k = max(ks)
    racing = [not g and c for g, c in zip(greedy, coupled, strict=True)]  # coupled: greedy on p / E
    rejecting = [not g and not c for g, c in zip(greedy, coupled, strict=True)]

    if any(racing):  # the target's keyed race scores p / E(seed, t) at every position of those rows
        starts = [0]
        for k in ks:
            starts.append(starts[-1] + k + 1)
        flat = [starts[i] + j for i in range(num_reqs) if racing[i] for j in range(ks[i] + 1)]
        flat_seeds = [int(seeds[i]) for i in range(num_reqs) if racing[i] for _ in range(ks[i] + 1)]  # type: ignore[arg-type]
        flat_pos = [int(positions[i]) + j for i in range(num_reqs) if racing[i] for j in range(ks[i] + 1)]
        noise = keyed_exponential(flat_seeds, flat_pos, STREAM_SAMPLE, vocab, device).to(dtype)
        noise.clamp_min_(torch.finfo(dtype).tiny)  # an exact 0 would make 0/0 = NaN win
        rows_t = torch.tensor(flat, device=device)
        target_probs = target_probs.index_put((rows_t,), target_probs[rows_t] / noise)  # [sum(k_i + 1), vocab]
    if not any(rejecting):
        return accept_greedy(target_probs.argmax(dim=-1).tolist(), draft_token_ids)  # one argmax for all

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
    as_greedy = torch.tensor([not r for r in rejecting], dtype=torch.bool, device=device)  # [N]

    # ---- keyed randomness of the rejection-sampling rows (the others' is ignored by the op):
    # U(seed, position + j) for the accept test at draft j, E(seed, final position) for the final race
    rej = [i for i in range(num_reqs) if rejecting[i]]
    rej_t = torch.tensor(rej, device=device)
    rej_seeds = [int(seeds[i]) for i in rej]  # type: ignore[arg-type]
    base = torch.tensor([int(positions[i]) for i in rej], dtype=torch.int64, device=device)  # [R]
    uniforms = torch.zeros(num_reqs, max_k, dtype=dtype, device=device)  # [N, K]
    if max_k:
        u_pos = (base.unsqueeze(1) + torch.arange(max_k, device=device)).reshape(-1)  # [R * K]
        u = keyed_uniform([s for s in rej_seeds for _ in range(max_k)], u_pos, STREAM_ACCEPT, 1, device)
        uniforms[rej_t] = u.view(len(rej), max_k).to(dtype)

    accept_fn = dispatch.impl("rejection_accept", device)
    noise = torch.ones(num_reqs, vocab, dtype=dtype, device=device)  # [N, V]
    if max_k:  # where the final token falls depends on the accept tests, not on the noise
        num_accepted_t, _ = accept_fn(p_pad, q_pad, ids_pad, num_draft, uniforms, noise, as_greedy)  # [N]
        final_pos = base + num_accepted_t[rej_t]  # [R]
    else:
        final_pos = base
    noise[rej_t] = keyed_exponential(rej_seeds, final_pos, STREAM_SAMPLE, vocab, device).to(dtype)
    num_accepted_t, final_t = accept_fn(p_pad, q_pad, ids_pad, num_draft, uniforms, noise, as_greedy)  # [N], [N]
    num_accepted, final = torch.stack([num_accepted_t, final_t]).tolist()  # one host sync

    token_ids = [[int(t) for t in draft_token_ids[i][: num_accepted[i]]] + [int(final[i])] for i in range(num_reqs)]
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)
