"""Torch reference twins of the hot ops. They run everywhere, define what the Triton
kernels must compute, and are what the dispatch point picks on CPU.

KV cache layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftwise.kernels.metadata import AttentionMetadata

# Sequences with at most this many new tokens (decode, verify, short chunks) are attended
# together in padded batches; longer prompt chunks one at a time.
SHORT_QUERY_MAX = 32
# The padded batches: sequences grouped by new-token count, each group padded to its longest
# (1: decode; then verify rounds and short chunks up to each bound). One group for all would
# pad sixteen decode rows to eight queries each when one request verifies seven drafts: the
# attention of that step cost about as much as eight decode steps' (docs/benchmarks.md,
# "Attention groups").
SHORT_GROUP_BOUNDS = (1, 4, 8, 16, SHORT_QUERY_MAX)


def write_kv_cache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; with skip_negative, -1 means "do not write"
    skip_negative: bool = False,
) -> None:
    """Store each new token's key and value at its slot. With ``skip_negative`` (the batch
    holds padding: a CUDA-graph runner pads up to its bucket with slot -1) tokens with a
    negative slot are left out; the caller knows this per forward pass, so the common case
    stays one ``index_copy_`` per cache with no check (the Triton kernel skips negative slots
    always, for free)."""
    h, d = k_cache.shape[-2:]
    if skip_negative:
        keep = (slot_mapping >= 0).nonzero().squeeze(1)  # [T_kept]
        k, v, slot_mapping = k.index_select(0, keep), v.index_select(0, keep), slot_mapping.index_select(0, keep)
    k_cache.view(-1, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual`` (or ``x``), then RMSNorm of it in float32.

    Returns ``(normed, residual')``, as Hugging Face's Llama computes them.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    if dtype == torch.float32:  # torch's fused op computes exactly this in float32
        return F.rms_norm(x, weight.shape, weight, eps), x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def rejection_accept(
    target_probs: torch.Tensor,  # [N, K + 1, V] float: p at each draft position, then the bonus position
    draft_probs: torch.Tensor | None,  # [N, K, V] float q; None: q one-hot at the drafted token
    draft_ids: torch.Tensor,  # [N, K] int64, padded with any valid id
    num_draft: torch.Tensor,  # [N] int64: k_i <= K real draft tokens per row
    uniforms: torch.Tensor,  # [N, K] same dtype as target_probs: U[0, 1) per draft position
    exp_noise: torch.Tensor,  # [N, V] same dtype as target_probs: Exp(1) per vocabulary entry
    greedy: torch.Tensor,  # [N] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [N] int64, final_token [N] int64
    """The rejection sampler's accept-and-resample step on padded tensors (see
    :mod:`draftwise.worker.speculative.rejection_sampler` for the rule and why it is exact).

    Sampling rows accept draft ``j < k_i`` while ``u_j < p_j(x_j) / q_j(x_j)`` (``q = 0 < p``
    accepts, ``p = 0`` rejects); greedy rows while ``x_j == argmax p_j``. With ``a`` accepted,
    the final token is ``argmax(w / max(E, tiny))`` (an exponential race: a draw from
    ``w / sum(w)``) where ``w`` is, for a sampling row rejected at ``a``, the residual
    ``max(0, p_a - q_a)`` (or ``p_a`` without ``x_a`` when ``draft_probs`` is None) if it has
    mass, else ``p_a``; for a greedy row the noise is 1, so it emits ``argmax p_a``.
    Uniforms and noise of greedy rows, and everything past ``k_i``, are ignored.
    """
    n, k1, v = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    rows = torch.arange(n, device=device)  # [N]
    num_accepted = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
    if k > 0:
        p_x = target_probs[:, :k].gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [N, K]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)  # [N, K]
        else:
            q_x = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2).to(p_x.dtype)  # [N, K]
        # u < p/q is exact at the edges: q == 0 < p -> inf (accepted); p == 0 -> 0 or NaN (rejected).
        accept = uniforms < p_x / q_x  # [N, K]
        greedy_rows = greedy.nonzero().squeeze(1)  # [G]
        if greedy_rows.numel():
            best = target_probs[greedy_rows, :k].argmax(dim=-1)  # [G, K]
            accept[greedy_rows] = draft_ids[greedy_rows] == best
        accept &= torch.arange(k, device=device) < num_draft.unsqueeze(1)  # padding counts as rejected
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [N]: leading run of accepts
    p_final = target_probs[rows, num_accepted]  # [N, V]
    weights = p_final
    if k > 0:
        rejected = (num_accepted < num_draft) & ~greedy  # [N]
        at = num_accepted.clamp(max=k - 1)  # [N]: the rejected position (clamped where nothing was)
        if draft_probs is None:
            residual = p_final.scatter(1, draft_ids[rows, at].unsqueeze(1), 0.0)  # [N, V]: p without x
        else:
            residual = (p_final - draft_probs[rows, at].to(p_final.dtype)).clamp_min(0.0)  # [N, V]
        has_mass = (residual > 0).any(dim=-1)  # [N]: an empty residual falls back to p
        weights = torch.where((rejected & has_mass).unsqueeze(1), residual, p_final)  # [N, V]
    # Exp(1) can be exactly 0; 0/0 would win as NaN. Greedy rows race with unit noise: argmax p.
    noise = torch.where(greedy.unsqueeze(1), 1.0, exp_noise.clamp_min(torch.finfo(exp_noise.dtype).tiny))  # [N, V]
    final = (weights / noise).argmax(dim=-1)  # [N]
    return num_accepted, final


@dataclass
class _ShortGroup:
    token_index: torch.Tensor  # [G, Qmax] flat index of each query (padding points at a valid token)
    padded_valid: torch.Tensor  # [n_valid] positions in the flattened [G * Qmax] that are real queries
    flat_valid_index: torch.Tensor  # [n_valid] their flat token indices
    dense: bool  # the group is the whole batch, in order, unpadded: no gather or scatter needed
    single_len: int | None  # one sequence of one query: attend to its first single_len keys, no mask
    block_tables: torch.Tensor  # [G, nb]
    q_pos: torch.Tensor  # [G, Qmax] absolute position of each query
    key_pos: torch.Tensor  # [nb * block_size]
    seq_lens: torch.Tensor  # [G]
    masks: dict[int | None, torch.Tensor]  # window -> [G, 1, Qmax, L] bool


@dataclass
class _LongSeq:
    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # [nb] block ids covering the context
    masks: dict[int | None, torch.Tensor]  # window -> [q, L] bool


@dataclass
class _Plan:
    short: list[_ShortGroup]  # by new-token count (SHORT_GROUP_BOUNDS)
    long: list[_LongSeq]


def _plan(meta: AttentionMetadata) -> _Plan:
    plan = meta.backend_state.get("torch")
    if plan is not None:
        return plan
    qsl = [0]
    for q in meta.query_lens_cpu:
        qsl.append(qsl[-1] + q)
    long_ids = [i for i, q in enumerate(meta.query_lens_cpu) if q > SHORT_QUERY_MAX]
    buckets: dict[int, list[int]] = {}
    for i, q in enumerate(meta.query_lens_cpu):
        if q <= SHORT_QUERY_MAX:
            buckets.setdefault(bisect.bisect_left(SHORT_GROUP_BOUNDS, q), []).append(i)
    short = [
        _short_group(meta, qsl, ids, whole=not long_ids and len(buckets) == 1) for _, ids in sorted(buckets.items())
    ]
    plan = _Plan(short=short, long=[_long_seq(meta, qsl, i) for i in long_ids])
    meta.backend_state["torch"] = plan
    return plan


def _long_seq(meta: AttentionMetadata, qsl: list[int], i: int) -> _LongSeq:
    s = meta.seq_lens_cpu[i]
    return _LongSeq(qsl[i], qsl[i + 1], s, meta.block_tables[i, : -(-s // meta.block_size)].long(), {})


def _short_group(meta: AttentionMetadata, qsl: list[int], ids: list[int], whole: bool) -> _ShortGroup:
    """The padded batch of sequences ``ids`` (``whole``: they are the whole batch)."""
    device = meta.slot_mapping.device
    bs = meta.block_size
    qmax = max(meta.query_lens_cpu[i] for i in ids)
    lmax = max(meta.seq_lens_cpu[i] for i in ids)
    nb = -(-lmax // bs)
    tok, val, pos = [], [], []
    for i in ids:
        q, s = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        tok.append([qsl[i] + min(j, q - 1) for j in range(qmax)])
        val.append([j < q for j in range(qmax)])
        pos.append([s - q + j if j < q else 0 for j in range(qmax)])
    flat_val = [i for i, v in enumerate(x for row in val for x in row) if v]
    flat_tok = [x for row, vrow in zip(tok, val, strict=True) for x, v in zip(row, vrow, strict=True) if v]
    idx = torch.tensor(ids, dtype=torch.int64, device=device)
    return _ShortGroup(
        token_index=torch.tensor(tok, dtype=torch.int64, device=device),
        padded_valid=torch.tensor(flat_val, dtype=torch.int64, device=device),
        flat_valid_index=torch.tensor(flat_tok, dtype=torch.int64, device=device),
        dense=whole and len(flat_val) == len(ids) * qmax,
        single_len=meta.seq_lens_cpu[ids[0]] if len(ids) == 1 and qmax == 1 else None,
        block_tables=meta.block_tables.index_select(0, idx)[:, :nb].long(),
        q_pos=torch.tensor(pos, dtype=torch.int64, device=device),
        key_pos=torch.arange(nb * bs, device=device),
        seq_lens=meta.seq_lens.index_select(0, idx).long(),
        masks={},
    )


def _short_mask(g: _ShortGroup, window: int | None) -> torch.Tensor:
    m = g.masks.get(window)
    if m is None:
        kp = g.key_pos[None, None, :]  # [1, 1, L]
        qp = g.q_pos[:, :, None]  # [G, Qmax, 1]
        m = (kp <= qp) & (kp < g.seq_lens[:, None, None])
        if window is not None:
            m &= kp > qp - window
        m = m[:, None]  # [G, 1, Qmax, L]
        g.masks[window] = m
    return m


def _long_mask(s: _LongSeq, window: int | None, device: torch.device) -> torch.Tensor:
    if window in s.masks:
        return s.masks[window]
    q = s.end - s.start
    qp = torch.arange(s.seq_len - q, s.seq_len, device=device)[:, None]
    kp = torch.arange(s.seq_len, device=device)[None, :]
    m = kp <= qp
    if window is not None:
        m &= kp > qp - window
    s.masks[window] = m
    return m


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole context, read from the
    paged cache (the new tokens' KV must already be written)."""
    plan = _plan(meta)
    out = torch.empty_like(q)
    h, d = k_cache.shape[-2:]
    gqa = q.shape[1] != h
    for g in plan.short:
        G = g.block_tables.shape[0]
        qmax = g.token_index.shape[1]
        flat = g.block_tables.view(-1)  # index_select copies whole blocks: far faster than advanced indexing
        keys = k_cache.index_select(0, flat).view(G, -1, h, d)  # [G, L, Hkv, D]
        vals = v_cache.index_select(0, flat).view(G, -1, h, d)
        mask = None
        if g.single_len is not None and (sliding_window is None or g.single_len <= sliding_window):
            keys, vals = keys[:, : g.single_len], vals[:, : g.single_len]
        else:
            mask = _short_mask(g, sliding_window)
        qq = q.view(G, qmax, *q.shape[1:]) if g.dense else q[g.token_index]  # [G, Qmax, H, D]
        o = F.scaled_dot_product_attention(
            qq.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            vals.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        ).transpose(1, 2)  # [G, Qmax, H, D]
        if g.dense:  # the whole batch: nothing else to fill in
            return o.reshape(q.shape)
        out.index_copy_(0, g.flat_valid_index, o.reshape(G * qmax, *q.shape[1:]).index_select(0, g.padded_valid))
    for s in plan.long:
        _attend_long(q, k_cache, v_cache, s, scale, sliding_window, out)
    return out


def _attend_long(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: _LongSeq, scale: float, window: int | None, out
) -> None:
    h, d = k_cache.shape[-2:]
    keys = k_cache.index_select(0, s.blocks).view(-1, h, d)[: s.seq_len].transpose(0, 1)[None]  # [1, Hkv, L, D]
    vals = v_cache.index_select(0, s.blocks).view(-1, h, d)[: s.seq_len].transpose(0, 1)[None]
    qq = q[s.start : s.end].transpose(0, 1)[None]  # [1, H, q, D]
    # A sequence's first chunk (no earlier context, no window) is plain causal attention: is_causal lets torch's
    # blocked kernel skip the blocks above the diagonal that a mask makes it compute (a 1,024-token prompt's
    # attention 14.0 -> 10.1 ms a layer on 2 cores), with the same bits (tests/unit/test_kernels_reference.py).
    first = window is None and s.seq_len == s.end - s.start
    o = F.scaled_dot_product_attention(
        qq,
        keys.to(q.dtype),
        vals.to(q.dtype),
        attn_mask=None if first else _long_mask(s, window, q.device),
        is_causal=first,
        scale=scale,
        enable_gqa=q.shape[1] != h,
    )
    out[s.start : s.end] = o[0].transpose(0, 1)


def paged_attention_of(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    ids: list[int],
) -> None:
    """``paged_attention``'s rows of the sequences ``ids`` written into ``out``, each sequence on its own (as
    the twin attends a long prompt chunk): for a kernel that leaves some sequences to torch. ``ids`` must be
    the same for every call of one forward pass (its layers)."""
    seqs = meta.backend_state.get("torch-long")  # built once per forward pass, with their masks, as _plan's
    if seqs is None:
        qsl = [0]
        for n in meta.query_lens_cpu:
            qsl.append(qsl[-1] + n)
        seqs = meta.backend_state["torch-long"] = [_long_seq(meta, qsl, i) for i in ids]
    for s in seqs:
        _attend_long(q, k_cache, v_cache, s, scale, sliding_window, out)
