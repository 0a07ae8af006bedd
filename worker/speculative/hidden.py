"""Proposers that read the target's hidden states: EAGLE and Medusa heads
(:mod:`draftwise.worker.speculative.heads`).

The target's forward pass hands them the final hidden state of every token it computed
(:meth:`HiddenStateProposer.observe`, right after the pass, before verification): no extra
pass of the target. Per request they keep a :class:`Track`: the feature ``f_{M-1}`` of the
last position the target has computed (``M`` tokens computed), what the EAGLE layer's KV
cache holds, and, after a verify pass, the features of its ``k + 1`` positions until
:meth:`settle` knows how many were accepted.

In steady decoding a request of ``N`` tokens has ``M = N - 1`` (its last token is not yet
computed) and ``f_{N-2}``, the state its last token was sampled from:

- **Medusa** drafts ``x_N .. x_{N+k-1}`` from ``f_{N-2}`` alone, head ``i`` giving ``x_{N-1+i}``;
- **EAGLE** runs its layer over the positions it lags behind, up to ``N - 1`` (each position
  ``t`` reads ``(x_t, f_{t-1})``: after a round with ``a`` accepted drafts, those ``a`` and the
  bonus token), drafts ``d_1`` from the last, then feeds its own output back for
  ``d_2 .. d_k`` at positions ``N .. N+k-2`` (scratch KV, overwritten later). After the
  verify pass ``settle`` keeps the features of the accepted positions for the next round:
  the EAGLE cache only ever holds positions read with the target's real features.
  When the target's prefill started after a cached prefix (``Request.prefill_start``), no
  features exist before it: the head's context starts there (its positions count from that
  ``base``; attention only sees relative positions), as if the sequence began there.

Draft tokens come from the head's draft vocabulary; q is the request's own processed
distribution over it (:func:`~draftwise.worker.sampling.sampler.processed_probs` of the draft
logits placed in the target's vocabulary, -inf elsewhere), drawn with keyed noise like every
draft, so exact rejection sampling and the seeded coupling apply unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draftwise.kernels import AttentionMetadata, get_attention_backend
from draftwise.kernels.flat_batch import FlatBatch
from draftwise.worker.core.block_manager import BlockManager, BlockTable
from draftwise.worker.core.request import Request
from draftwise.worker.model.block_tables import BlockTableRows
from draftwise.worker.model.chunk import SequenceChunk
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.llama import LlamaModel
from draftwise.worker.sampling.sampler import processed_probs, sample_from_probs
from draftwise.worker.speculative.draft import plain_greedy
from draftwise.worker.speculative.heads import EagleHead, LoadedHead, MedusaHeads, head_model_config
from draftwise.worker.speculative.proposer import Observed, Proposal, Proposer

__all__ = ["EagleProposer", "HiddenStateProposer", "MedusaProposer", "Track"]

MAX_TAIL = 17  # a verify pass has at most 1 + MAX_SPECULATIVE_TOKENS positions: their features wait for settle


@dataclass
class Track:
    """One request's hidden-state bookkeeping."""

    computed: int = 0  # target positions whose features were seen (< computed); EAGLE: also its KV
    last_feat: torch.Tensor | None = None  # [hidden]: f_{computed - 1}
    tail: torch.Tensor | None = None  # [n, hidden]: the last verify pass's features
    tail_start: int = 0  # position of tail[0]
    block_table: list[int] = field(default_factory=BlockTable)  # EAGLE: blocks of the head's own pool
    kv: int = 0  # EAGLE: positions in its KV cache (< kv), read with the target's real features
    pending: list[torch.Tensor] = field(default_factory=list)  # EAGLE: f_{kv - 1} .. f_{computed - 1}, not read yet
    base: int = 0  # the first position the target computed (after a cached prefix): EAGLE's position 0


class HiddenStateProposer(Proposer):
    """What EAGLE and Medusa share: tracking the target's features per request, drafting
    from the draft vocabulary."""

    wants_hidden = True

    def __init__(self, head: LoadedHead, target: LlamaModel, target_vocab: int) -> None:
        self.head = head
        self.target = target
        self.target_vocab = target_vocab
        self.tracks: dict[str, Track] = {}

    def can_draft(self, req: Request) -> bool:
        """Only a request whose every computed position was observed, up to its last token."""
        t = self.tracks.get(req.request_id)
        return t is not None and t.computed == req.num_tokens - 1 and t.last_feat is not None

    def backlog(self, req: Request) -> int:
        return 0 if self.can_draft(req) else req.num_tokens

    def observe(self, items: Sequence[Observed]) -> None:
        """The target computed ``items``' tokens: remember their features (EAGLE: and runs its
        layer over them). A request whose earlier positions were not all seen (state lost to
        a failure) is dropped: it is not drafted for again (:meth:`can_draft`)."""
        for it in items:
            self._track(it, it.rows.clone())

    def _track(self, it: Observed, rows: torch.Tensor) -> Track | None:
        """Move ``it``'s track on over its positions, whose features ``rows`` are a copy (a view
        would keep the whole step's hidden states alive as long as the request); None when the
        request is dropped."""
        t = self.tracks.get(it.request.request_id)
        if t is None and it.start == it.request.prefill_start:
            t = self.tracks[it.request.request_id] = Track(computed=it.start, kv=it.start, base=it.start)
        if t is None or t.computed not in (it.start, it.start + 1):
            self.release(it.request)
            return None
        n = len(it.token_ids)
        t.tail, t.tail_start = (rows, it.start) if n <= MAX_TAIL else (None, 0)
        t.last_feat = rows[-1] if t.tail is not None else rows[-1].clone()  # a view only where the tail keeps rows
        t.computed = it.start + n
        return t

    def settle(self, req: Request, num_tokens_before: int, k: int, accepted: int) -> None:
        """Keep the features of the accepted prefix: f up to position ``N - 1 + accepted``."""
        t = self.tracks.get(req.request_id)
        if t is None or t.tail is None or t.tail_start != num_tokens_before - 1:
            self.release(req)
            return
        t.last_feat = t.tail[accepted]
        t.computed = num_tokens_before + accepted
        t.tail = None

    def release(self, req: Request) -> None:
        self.tracks.pop(req.request_id, None)

    def reset(self, req: Request) -> None:
        """Nothing to undo after a failed batch call: proposing changes no track."""

    def check(self, reqs: Sequence[Request]) -> None:
        by_id = {r.request_id: r for r in reqs}
        stray = set(self.tracks) - set(by_id)
        if stray:
            raise AssertionError(f"hidden-state tracks kept for requests that are gone: {sorted(stray)}")
        for rid, t in self.tracks.items():
            if t.computed > by_id[rid].num_tokens:
                raise AssertionError(f"{rid}: {t.computed} positions tracked > {by_id[rid].num_tokens} tokens")

    def check_idle(self) -> None:
        self.check([])

    def _logits(self, g: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, V_d] float32
        return self.head.lm_head(g).float()

    def _draw(
        self, logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[Sequence[int]], need_q: bool
    ) -> tuple[torch.Tensor | None, list[int]]:
        """One draft per row from draft-vocabulary logits ``[n, V_d]``; q in the target's
        vocabulary when some request of the batch samples (see DraftModelProposer._draw)."""
        ids = self.head.draft_ids
        if not need_q and all(plain_greedy(r, len(d)) for r, d in zip(reqs, drafts, strict=True)):
            return None, [int(t) for t in ids[logits.argmax(dim=-1)].tolist()]
        full = torch.full((logits.shape[0], self.target_vocab), -torch.inf, dtype=torch.float32, device=logits.device)
        full[:, ids] = logits
        rows = [r.sampling_row(d) for r, d in zip(reqs, drafts, strict=True)]
        q = processed_probs(full, rows)  # [n, target vocab]
        return q, [int(t) for t in sample_from_probs(q, rows, draft=True).tolist()]

    def _proposal(
        self,
        drafts: list[list[int]],
        q_rows: list[list[torch.Tensor]],
        ks: Sequence[int],
        need_q: bool,
        t0: float,
        steps: int,
    ) -> Proposal:
        if need_q and any(len(rows) != k for rows, k in zip(q_rows, ks, strict=True)):
            raise RuntimeError(f"{self.name} proposer: a sampling batch is missing q at a drafted position")
        probs = torch.stack([t for rows in q_rows for t in rows]) if need_q else None
        seconds = time.perf_counter() - t0
        return Proposal(drafts, probs, seconds, seconds / max(1, steps), len(drafts))


class MedusaProposer(HiddenStateProposer):
    """Medusa heads: every draft of a request from its one feature ``f_{N-2}``."""

    name = "medusa"

    def plan(self, req: Request, k: int) -> int:
        module = self.head.module
        assert isinstance(module, MedusaHeads)
        return min(k, module.num_heads)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        t0 = time.perf_counter()
        module = self.head.module
        assert isinstance(module, MedusaHeads)
        feats = torch.stack([self._feature(r) for r in reqs])  # [n, hidden]
        hs = module(feats)  # [n, K, hidden]
        need_q = any(not r.sampling_params.is_greedy for r in reqs)
        drafts: list[list[int]] = [[] for _ in reqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in reqs]
        logits = self._logits(hs[:, : max(ks)].reshape(-1, hs.shape[-1])).view(len(reqs), max(ks), -1)
        for j in range(max(ks)):
            active = [i for i, k in enumerate(ks) if k > j]
            q, toks = self._draw(logits[active, j], [reqs[i] for i in active], [drafts[i] for i in active], need_q)
            for row, i in enumerate(active):
                drafts[i].append(toks[row])
                if q is not None:
                    q_rows[i].append(q[row])
        return self._proposal(drafts, q_rows, ks, need_q, t0, max(ks))

    def _feature(self, req: Request) -> torch.Tensor:
        t = self.tracks.get(req.request_id)
        if t is None or t.last_feat is None or t.computed != req.num_tokens - 1:
            raise RuntimeError(f"request {req.request_id}: no feature for its last token")
        return t.last_feat


class EagleProposer(HiddenStateProposer):
    """An EAGLE head with its own one-layer paged KV cache (as many blocks as the target's).

    It reads the target's features lazily: :meth:`observe` only keeps them (``Track.pending``:
    ``f_{kv - 1} .. f_{computed - 1}``, ``f_{-1} = 0``), and the layer runs over the positions
    it lags behind (``kv .. N - 1``) in the first pass of the next proposal (steady decoding:
    the accepted drafts and the bonus token, ``a + 1`` positions) or, further behind (after
    the prompt, or steps without drafting), through the budgeted :meth:`catch_up`. A step that
    drafts nothing costs it nothing but a copy of the features."""

    name = "eagle"
    inline_backlog = 1 + MAX_TAIL  # a whole accepted round is read inline, in the proposal's first pass
    max_pending = 8192  # features kept per request at most; a request further behind stops speculating

    def __init__(
        self, head: LoadedHead, target: LlamaModel, target_vocab: int, num_blocks: int, block_size: int
    ) -> None:
        super().__init__(head, target, target_vocab)
        module = head.module
        assert isinstance(module, EagleHead)
        self.module = module
        dtype, device = head.dtype, head.device
        self.kv_cache = KVCache(head_model_config(target.config), num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.backend = get_attention_backend(device)
        self.block_rows = BlockTableRows(device)
        self.device = device

    def _run(
        self, chunks: Sequence[SequenceChunk], feats: torch.Tensor
    ) -> torch.Tensor:  # -> [T or logit rows, hidden]
        """The layer over ``chunks`` (each token with its feature, in order); g at every token,
        or only at the logit rows when some chunk asks for logits."""
        batch = FlatBatch.build(chunks, self.kv_cache.block_size, self.target.rope.max_positions)
        dev = batch.upload(self.device)
        meta = AttentionMetadata.for_batch(
            batch, dev, self.block_rows.gather(batch.block_tables), self.kv_cache.block_size
        )
        emb = self.target._embed(dev.input_ids)  # noqa: SLF001 - the target's embedding, shared
        cos_sin = self.target.rope.cos_sin(dev.positions, emb.dtype)
        g = self.module(emb, feats.to(emb.dtype), cos_sin, self.kv_cache.layers[0], meta, self.backend)
        return g if batch.logit_rows.shape[0] in (0, batch.num_tokens) else g[dev.logit_rows]

    def observe(self, items: Sequence[Observed]) -> None:
        """Keep the features of each request's new positions (a verify pass's wait for
        :meth:`settle`, which knows how many of them are real)."""
        for it in items:
            verify = it.request.request_id in self.tracks and it.num_drafts > 0  # by this head or a hybrid's lookup
            rows = it.rows.clone()  # one copy: the track's tail and the features kept share it (never written)
            t = self._track(it, rows)
            if t is None:
                continue
            if not t.pending and t.kv == t.base:
                t.pending.append(torch.zeros_like(rows[0])[None])  # f_{base - 1}: unseen, as f_{-1}
            if not verify:
                t.pending.append(rows)
                if len(t.pending) > 64:  # steps without drafting: one tensor, so that catching up stays cheap
                    t.pending = [torch.cat(t.pending)]
                if t.computed - t.kv + 1 > self.max_pending:  # kept: f_{kv - 1} .. f_{computed - 1}
                    self.release(it.request)

    def settle(self, req: Request, num_tokens_before: int, k: int, accepted: int) -> None:
        t = self.tracks.get(req.request_id)
        tail = None if t is None else t.tail
        super().settle(req, num_tokens_before, k, accepted)
        t = self.tracks.get(req.request_id)
        if t is not None and tail is not None:
            # f_{N-1} .. f_{N-1+a}, after what the head has not read yet: nothing when it drafted this round
            # (its proposal read up to N - 1); in a hybrid whose lookup drafted, the positions it lags behind
            t.pending.append(tail[: accepted + 1])
            self.blocks.shrink(t.block_table, t.kv - t.base)

    def release(self, req: Request) -> None:
        t = self.tracks.pop(req.request_id, None)
        if t is not None:
            self.blocks.free(t.block_table)

    def backlog(self, req: Request) -> int:
        """EAGLE positions to compute before drafting: ``kv .. N - 1``."""
        t = self.tracks.get(req.request_id)
        return req.num_tokens if t is None or not self.can_draft(req) else req.num_tokens - t.kv

    def _catch_up_chunks(
        self, reqs: Sequence[Request], ns: Sequence[int], num_logits: int
    ) -> tuple[list[SequenceChunk], torch.Tensor, list[Track], list[tuple[Track, int, list[torch.Tensor]]]]:
        """Chunks for the next ``ns[i]`` positions each request lags behind, their features,
        the tracks, and how each track moves on once the pass has succeeded (:meth:`_commit`).
        The features are the target's rows fused into one per position (EAGLE-3's feature
        layers; the rows themselves without)."""
        chunks, feats, tracks, moves = [], [], [], []
        for r, n in zip(reqs, ns, strict=True):
            t = self.tracks.get(r.request_id)
            if t is None or not self.can_draft(r) or not 1 <= n <= self.backlog(r):
                raise RuntimeError(f"request {r.request_id}: cannot read {n} positions (its features are not all seen)")
            rows = torch.cat(t.pending) if len(t.pending) > 1 else t.pending[0]
            if rows.shape[0] != r.num_tokens - t.kv:
                raise RuntimeError(
                    f"request {r.request_id}: {rows.shape[0]} features kept for {r.num_tokens - t.kv} positions"
                )
            self._grow(t, t.kv - t.base + n)
            chunks.append(SequenceChunk(r.token_slice(t.kv, t.kv + n), t.kv - t.base, t.block_table, num_logits))
            feats.append(rows[:n])
            moves.append((t, t.kv + n, [rows[n:]] if n < rows.shape[0] else []))
            tracks.append(t)
        return chunks, self.module.fused(torch.cat(feats)), tracks, moves

    @staticmethod
    def _commit(moves: Sequence[tuple[Track, int, list[torch.Tensor]]]) -> None:
        for t, kv, pending in moves:
            t.kv, t.pending = kv, pending

    @torch.inference_mode()
    def catch_up(self, reqs: Sequence[Request], ns: Sequence[int]) -> None:
        chunks, feats, _, moves = self._catch_up_chunks(reqs, ns, 0)
        self._run(chunks, feats)
        self._commit(moves)

    def _grow(self, t: Track, num_tokens: int) -> None:
        if not self.blocks.grow(t.block_table, num_tokens):
            raise RuntimeError("EAGLE KV pool exhausted (the engine sizes it to never run out)")

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        """The positions each request lags behind (real tokens and features; logits at its
        last token, ``N - 1``), then ``k - 1`` drafting positions fed with the head's own output."""
        t0 = time.perf_counter()
        if any(k < 1 for k in ks):
            raise ValueError(f"k must be >= 1, got {list(ks)}")
        ends = [r.num_tokens for r in reqs]
        chunks, feats, tracks, moves = self._catch_up_chunks(reqs, [self.backlog(r) for r in reqs], 1)
        for t, e, k in zip(tracks, ends, ks, strict=True):
            self._grow(t, e - t.base + k - 1)
        need_q = any(not r.sampling_params.is_greedy for r in reqs)
        drafts: list[list[int]] = [[] for _ in reqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        for j in range(max(ks)):
            g = self._run(chunks, feats)  # [len(active), hidden]: at each request's newest position
            q, toks = self._draw(self._logits(g), [reqs[i] for i in active], [drafts[i] for i in active], need_q)
            for row, i in enumerate(active):
                drafts[i].append(toks[row])
                if q is not None:
                    q_rows[i].append(q[row])
            keep = [row for row, i in enumerate(active) if ks[i] > j + 1]
            active = [active[row] for row in keep]
            if not active:
                break
            chunks = [
                SequenceChunk([drafts[i][-1]], ends[i] + j - tracks[i].base, tracks[i].block_table, 1) for i in active
            ]
            feats = g[keep]
        prop = self._proposal(drafts, q_rows, ks, need_q, t0, max(ks))
        self._commit(moves)
        return prop

    def check(self, reqs: Sequence[Request]) -> None:
        super().check(reqs)
        self.blocks.pool.check(t.block_table for t in self.tracks.values())
        for rid, t in self.tracks.items():
            kept = sum(p.shape[0] for p in t.pending)
            if t.tail is None and kept != t.computed - t.kv + 1:
                raise AssertionError(f"{rid}: {kept} features kept for positions {t.kv - 1} .. {t.computed - 1}")

    def check_idle(self) -> None:
        self.check([])
        if self.blocks.num_free_blocks != self.blocks.num_blocks:
            raise AssertionError(f"{self.blocks.num_blocks - self.blocks.num_free_blocks} EAGLE blocks still in use")
