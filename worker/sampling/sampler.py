"""From a batch of logits to next tokens.

Order, as in vLLM: penalties -> min_tokens mask -> (greedy rows: argmax) -> temperature ->
top-k -> top-p -> min-p -> sample. Sampling is an exponential race, ``argmax(p / E)`` with
one Exp(1) variate per vocabulary entry (the Gumbel-max trick in another form), and the
``E`` of a row are keyed by (the request's seed, the absolute position of the token drawn)
(:mod:`draftwise.worker.sampling.keyed_random`): one batched computation for all rows, and a seeded
request produces the same tokens whatever else shares its batch, whatever speculation did
before, on whichever worker.

:func:`processed_probs` exposes the distribution actually sampled from, so that
speculative decoding can build its p (target) and q (draft) exactly the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.worker.sampling.keyed_random import STREAM_DRAFT, STREAM_SAMPLE, keyed_exponential
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.sampling.token_counts import TokenCounts, add_token_ids

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    """The request's sampling parameters."""
    seed: int | None
    """The request's seed (params.seed, or one drawn at random when it came without); None only for greedy rows."""
    prompt_token_ids: Sequence[int]
    """Prompt tokens (repetition penalty looks at these and the output)."""
    output_token_ids: Sequence[int]
    """Tokens generated so far (all penalties and min_tokens look at these, and at ``drafts``)."""
    eos_token_ids: Sequence[int] = ()
    """The model's EOS ids: masked, with params.stop_token_ids, until min_tokens are out (unless ignore_eos)."""
    drafts: Sequence[int] = ()
    """Drafted tokens after the output, as if already generated (a speculative position): kept
    apart so that a row per draft position never copies the whole output."""
    counts: TokenCounts | None = None
    """The request's token counts kept on the device between steps (penalised requests); None:
    counted from the token lists."""

    @property
    def num_output(self) -> int:
        """Output tokens this row counts as generated: the output and the drafts."""
        return len(self.output_token_ids) + len(self.drafts)

    @property
    def position(self) -> int:
        """The absolute position of the token this row draws: prompt plus output length."""
        return len(self.prompt_token_ids) + self.num_output

    def output_with_drafts(self) -> Sequence[int]:
        """The output followed by the drafts (a copy only when there are drafts)."""
        return [*self.output_token_ids, *self.drafts] if self.drafts else self.output_token_ids


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities, under the model's raw distribution, around one sampled token."""

    token_id: int
    """The sampled token."""
    logprob: float
    """Its log-probability."""
    rank: int
    """Its rank: 1 + the number of tokens strictly more likely (1 = most likely)."""
    top: tuple[tuple[int, float], ...]
    """The params.logprobs most likely (token, logprob), most likely first."""


@dataclass
class SamplerOutput:
    """One sampled token per row, in row order."""

    token_ids: list[int]
    """The next token of each row."""
    logprobs: list[TokenLogprobs | None]
    """Per row: None unless the row's params.logprobs is set."""


def _token_counts(
    seqs: Sequence[Sequence[int]],
    vocab: int,
    device: torch.device,
) -> torch.Tensor:  # [num_rows, vocab] int64
    """How often each token id occurs in each row's sequence."""
    lengths = [len(s) for s in seqs]
    max_len = max(lengths, default=0)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.int64, device=device)
    if max_len == 0:
        return counts[:, :vocab]
    ids = torch.tensor([list(s) + [0] * (max_len - len(s)) for s in seqs], dtype=torch.int64)  # [num_rows, max_len]
    valid = torch.arange(max_len).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [num_rows, max_len]
    real = ids[valid]
    if int(real.min()) < 0 or int(real.max()) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}) for a vocabulary of {vocab}")
    # Padding goes to the extra column ``vocab``, which is sliced away.
    ids = torch.where(valid, ids, vocab).to(device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]


def _penalty_counts(
    rows: Sequence[SamplingRow], needs_output: Sequence[bool], rep: Sequence[bool], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_rows, vocab] int counts of output + drafts, [num_rows, vocab] bool
    """Per row, how often each id occurs in its output (and drafts), and which ids its prompt
    holds (rows with a repetition penalty only). From each row's device-side
    :class:`TokenCounts` when it has one (no pass over the context), else from the lists."""
    if not all(r.counts is not None for r, need in zip(rows, needs_output, strict=True) if need):
        output_counts = _token_counts(
            [r.output_with_drafts() if need else () for r, need in zip(rows, needs_output, strict=True)], vocab, device
        )
        prompt_counts = _token_counts(
            [r.prompt_token_ids if need else () for r, need in zip(rows, rep, strict=True)], vocab, device
        )
        return output_counts, prompt_counts > 0
    no_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
    no_ids = torch.zeros(vocab, dtype=torch.bool, device=device)
    outs, seens = [], []
    for r, need, rp in zip(rows, needs_output, rep, strict=True):
        if not need or r.counts is None:
            outs.append(no_counts)
            seens.append(no_ids)
            continue
        out, seen = r.counts.sync(r.prompt_token_ids, r.output_token_ids, vocab, device)
        if r.drafts:
            out = add_token_ids(out.clone(), r.drafts)  # the kept counts stay the output's
        outs.append(out)
        seens.append(seen if rp else no_ids)
    return torch.stack(outs), torch.stack(seens)


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
) -> torch.Tensor:  # [num_rows, vocab], a new tensor where any row is penalised
    """Repetition penalty (HF/vLLM: over prompt + output tokens, positive logits divided by it,
    the others multiplied), then frequency and presence penalties (OpenAI: over output tokens
    only, ``- frequency * count - presence * (count > 0)``). Rows with default penalties are
    left bit for bit as they were. Does not modify ``logits``."""
    _check_batch(logits, rows)
    rep = [r.params.repetition_penalty != 1.0 for r in rows]
    freq_pres = [r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows]
    if not any(rep) and not any(freq_pres):
        return logits
    vocab, device = logits.shape[1], logits.device
    needs_output = [a or b for a, b in zip(rep, freq_pres, strict=True)]
    output_counts, prompt_seen = _penalty_counts(rows, needs_output, rep, vocab, device)  # [num_rows, vocab] each

    if any(rep):
        seen = prompt_seen | (output_counts > 0)  # [num_rows, vocab]
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype, device=device)
        penalty = torch.where(seen, penalty.unsqueeze(1), torch.ones((), dtype=logits.dtype, device=device))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)

    if any(freq_pres):
        freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype, device=device)
        pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype, device=device)
        logits = logits - freq.unsqueeze(1) * output_counts.to(logits.dtype)
        logits = logits - pres.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_min_tokens(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
) -> torch.Tensor:  # [num_rows, vocab]
    """Set to -inf the logits of stop_token_ids and (unless ignore_eos) EOS in every row that
    has generated fewer than min_tokens tokens. Does not modify ``logits``."""
    _check_batch(logits, rows)
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if r.num_output >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            banned.update(r.eos_token_ids)
        for t in sorted(banned):
            if 0 <= t < vocab:  # a stop id outside the model's vocabulary can never be sampled anyway
                row_idx.append(i)
                tok_idx.append(t)
    if not row_idx:
        return logits
    logits = logits.clone()
    logits[torch.tensor(row_idx, device=logits.device), torch.tensor(tok_idx, device=logits.device)] = _NEG_INF
    return logits


def _apply_top_k(
    logits: torch.Tensor,  # [num_rows, vocab]
    top_k: list[int],
) -> torch.Tensor:  # [num_rows, vocab]
    """Keep, per row, the tokens whose logit is at least the k-th largest (ties at the k-th are kept)."""
    vocab = logits.shape[1]
    k = [min(t, vocab) if t > 0 else vocab for t in top_k]
    if all(t == vocab for t in k):
        return logits
    k_t = torch.tensor(k, dtype=torch.int64, device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values  # [num_rows, vocab]
    kth = sorted_desc.gather(1, (k_t - 1).unsqueeze(1))  # [num_rows, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def _apply_top_p(
    logits: torch.Tensor,  # [num_rows, vocab]
    top_p: list[float],
) -> torch.Tensor:  # [num_rows, vocab]
    """Keep, per row, the smallest set of most likely tokens whose probability mass reaches
    top_p: a token stays when the mass of the tokens ranked above it is still below top_p,
    so the most likely token always stays."""
    active = [p < 1.0 for p in top_p]
    if not any(active):
        return logits
    device = logits.device
    probs = logits.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [num_rows, vocab] each
    # float64 cumulative sum: over a 100k+ vocabulary float32 rounding could move the cut.
    mass_above = sorted_probs.cumsum(dim=-1, dtype=torch.float64) - sorted_probs.double()
    p_t = torch.tensor(top_p, dtype=torch.float64, device=device).unsqueeze(1)  # [num_rows, 1]
    drop_sorted = (mass_above >= p_t) & torch.tensor(active, device=device).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, _NEG_INF)


def _apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab]
    min_p: list[float],
) -> torch.Tensor:  # [num_rows, vocab]
    """Keep, per row, the tokens with probability >= min_p * the row's largest probability."""
    if not any(m > 0.0 for m in min_p):
        return logits
    probs = logits.softmax(dim=-1)
    min_p_t = torch.tensor(min_p, dtype=probs.dtype, device=logits.device).unsqueeze(1)  # [num_rows, 1]
    threshold = min_p_t * probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def processed_probs(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
) -> torch.Tensor:  # [num_rows, vocab] float32
    """The distribution each row is actually sampled from: penalties, min_tokens mask,
    temperature, top-k, top-p, min-p; for greedy rows a one-hot at the argmax of the
    penalised, masked logits. Does not modify ``logits``."""
    _check_batch(logits, rows)
    logits = logits.float()
    if not rows:
        return logits.clone()
    logits = apply_penalties(logits, rows)
    logits = apply_min_tokens(logits, rows)
    greedy = [r.params.is_greedy for r in rows]
    if all(greedy):  # one-hot rows only: no softmax to build
        return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)

    temps = torch.tensor(
        [1.0 if g else r.params.temperature for r, g in zip(rows, greedy, strict=True)],
        dtype=logits.dtype,
        device=logits.device,
    )
    sampled = logits / temps.unsqueeze(1)
    sampled = _apply_top_k(sampled, [0 if g else r.params.top_k for r, g in zip(rows, greedy, strict=True)])
    sampled = _apply_top_p(sampled, [1.0 if g else r.params.top_p for r, g in zip(rows, greedy, strict=True)])
    sampled = _apply_min_p(sampled, [0.0 if g else r.params.min_p for r, g in zip(rows, greedy, strict=True)])
    probs = sampled.softmax(dim=-1)  # [num_rows, vocab]

    if any(greedy):
        g_t = torch.tensor(greedy, device=logits.device).unsqueeze(1)  # [num_rows, 1]
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(g_t, one_hot, probs)
    return probs


class Sampler:
    """Stateless: ``Sampler()(logits, rows)`` picks one next token per row."""

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32
        rows: Sequence[SamplingRow],
    ) -> SamplerOutput:
        _check_batch(logits, rows)
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        for i, r in enumerate(rows):
            if r.seed is None and not r.params.is_greedy:
                raise ValueError(f"row {i} samples (temperature {r.params.temperature}) but has no seed")
        if all(r.params.is_greedy for r in rows):  # fast path: no distribution to build
            token_ids = greedy_tokens(logits, rows)
        else:
            probs = processed_probs(logits, rows)  # [num_rows, vocab]
            token_ids = sample_from_probs(probs, rows)  # [num_rows]
        token_list = [int(t) for t in token_ids.tolist()]
        return SamplerOutput(token_ids=token_list, logprobs=token_logprobs(logits, rows, token_ids))


def greedy_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:  # [num_rows] int64
    """Greedy rows' tokens: the argmax of the penalised, min_tokens-masked logits (what
    :func:`processed_probs` puts its one-hot at). Every greedy choice, plain or verifying drafts, is this."""
    return apply_min_tokens(apply_penalties(logits.float(), rows), rows).argmax(dim=-1)


def sample_from_probs(
    probs: torch.Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
    draft: bool = False,
) -> torch.Tensor:  # [num_rows] int64
    """Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i.
    Each sampling row's E is keyed by (its seed, its position): the target's stream, or with
    ``draft`` the draft's stream for rows without ``params.seed`` (their drafts are verified
    by rejection sampling, which needs draws independent of the target's); seeded rows draft
    with the target's own noise (Gumbel coupling). Greedy rows (one-hot p) draw nothing."""
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not sampled:
        return probs.argmax(dim=-1)
    noise = keyed_noise(probs, [rows[i] for i in sampled], draft)  # [len(sampled), vocab]
    if len(sampled) < len(rows):
        full = torch.ones_like(probs)  # [num_rows, vocab]
        full[torch.tensor(sampled, device=probs.device)] = noise
        noise = full
    return (probs / noise).argmax(dim=-1)


def keyed_noise(
    probs: torch.Tensor,  # [num_rows, vocab]: for shape, dtype and device
    rows: Sequence[SamplingRow],  # sampling rows only (each with a seed)
    draft: bool = False,
) -> torch.Tensor:  # [num_rows, vocab], probs' dtype, >= the smallest normal float
    """The rows' Exp(1) noise at their positions (see :func:`sample_from_probs` for ``draft``),
    clamped away from 0 (an exact 0 would make 0/0 = NaN win the race)."""
    seeds: list[int] = []
    for i, r in enumerate(rows):
        if r.seed is None:
            raise ValueError(f"row {i} samples (temperature {r.params.temperature}) but has no seed")
        seeds.append(r.seed)
    vocab, device = probs.shape[1], probs.device
    streams = [STREAM_DRAFT if draft and r.params.seed is None else STREAM_SAMPLE for r in rows]
    if len(set(streams)) <= 1:
        noise = keyed_exponential(seeds, [r.position for r in rows], streams[0] if rows else 0, vocab, device)
    else:  # a draft step mixing seeded and unseeded rows: each group from its own stream
        noise = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)
        for stream in (STREAM_SAMPLE, STREAM_DRAFT):
            idx = [i for i, st in enumerate(streams) if st == stream]
            noise[torch.tensor(idx, device=device)] = keyed_exponential(
                [seeds[i] for i in idx], [rows[i].position for i in idx], stream, vocab, device
            )
    noise = noise.to(probs.dtype)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
    token_ids: torch.Tensor,  # [num_rows]
) -> list[TokenLogprobs | None]:
    """Raw log-probabilities (log_softmax of the logits as given) for rows that asked."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    idx = torch.tensor(wanted, device=logits.device)
    lp = logits[idx].float().log_softmax(dim=-1)  # [num_wanted, vocab]
    chosen = token_ids[idx].unsqueeze(1)  # [num_wanted, 1]
    chosen_lp = lp.gather(1, chosen)  # [num_wanted, 1]
    ranks = (lp > chosen_lp).sum(dim=-1) + 1  # [num_wanted]
    n_top = min(max(rows[i].params.logprobs or 0 for i in wanted), lp.shape[1])
    top_lp, top_ids = lp.topk(n_top, dim=-1)  # [num_wanted, n_top] each
    chosen_l, chosen_lp_l, ranks_l = chosen[:, 0].tolist(), chosen_lp[:, 0].tolist(), ranks.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        out[i] = TokenLogprobs(
            token_id=int(chosen_l[j]),
            logprob=float(chosen_lp_l[j]),
            rank=int(ranks_l[j]),
            top=tuple((int(t), float(v)) for t, v in zip(top_ids_l[j][:n], top_lp_l[j][:n], strict=True)),
        )
    return out


def _check_batch(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: Sequence[SamplingRow],
) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {list(logits.shape)}")
