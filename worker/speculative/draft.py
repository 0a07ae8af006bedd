"""The draft-model proposer: a small model with its own weights and its own paged KV cache
proposes k tokens for many requests at once, in batched draft steps (docs/engine.md, "Speculative decoding").

Per request the draft cache holds the KV of the sequence's first ``num_computed`` tokens, in
the request's draft block table (blocks of this proposer's own pool; both live in the
proposer, keyed by request id: :class:`DraftKV`). A proposal for a sequence of N tokens with
k drafts:

- step 0 (catch-up): the tokens the draft has not seen yet, ``[num_computed, N)`` —
  normally one (the token the target emitted last step) or two (a fully accepted round's
  last draft plus the bonus token), the whole prompt the first time — with logits for the
  last position: q_1, then d_1 ~ q_1;
- steps 1..k-1: d_j alone at position N + j - 1: q_{j+1}, d_{j+1} ~ q_{j+1}.

Requests with different k share the steps: a request drops out once it has its k tokens.
With prefix caching the draft pool caches its full blocks under the target's block hashes
(``Request.block_hashes``: they depend on the tokens and the tenant's salt alone): a request
met for the first time starts with the longest cached run of them, and only full blocks of real
tokens (never drafted positions) are offered to the cache.
Afterwards the draft cache holds N + k - 1 tokens; :meth:`DraftModelProposer.settle` keeps the
first N + min(accepted, k - 1) of them (the accepted prefix; rejected positions are simply
forgotten: their slots are overwritten later) and gives back blocks beyond.

q_j is built by :func:`~draftwise.worker.sampling.sampler.processed_probs` from the request's own
SamplingParams, over the output *including the drafts before j*, exactly as the engine
builds the target's p_j, so penalties, min_tokens, temperature, top-k/p and min-p shape both
the same way. Draft tokens are drawn with keyed noise at their positions
(:func:`~draftwise.worker.sampling.sampler.sample_from_probs` with ``draft=True``): a seeded request
proposes with the target's own noise (so that its drafts agree with the target's keyed
choices as often as the two distributions allow), the others from the draft's own stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draftwise.worker.core.block_manager import BlockManager, BlockTable
from draftwise.worker.core.request import FinishReason, Request
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import LoadedModel
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
from draftwise.worker.sampling.sampler import processed_probs, sample_from_probs
from draftwise.worker.speculative.proposer import Proposal, Proposer

__all__ = ["DraftKV", "DraftModelProposer", "plain_greedy"]


def plain_greedy(req: Request, num_drafted: int) -> bool:
    """Greedy with nothing that reshapes the logits at this position: no penalties and
    min_tokens already met (counting the tokens drafted before it)."""
    p = req.sampling_params
    return (
        p.is_greedy
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and len(req.output_token_ids) + num_drafted >= p.min_tokens
    )


@dataclass
class DraftKV:
    """One request's share of the draft cache."""

    block_table: list[int] = field(default_factory=BlockTable)  # blocks of the proposer's pool
    num_computed: int = 0  # tokens whose draft KV is in the cache
    vocab_checked: int = 0  # leading tokens of the request known to be inside the draft's vocabulary
    num_blocks_cached: int = 0  # leading blocks offered to the draft pool's prefix cache


class DraftModelProposer(Proposer):
    """A draft model, its KV cache, its block pool and each request's place in it."""

    name = "draft"

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, target_vocab: int, prefix_caching: bool = False
    ) -> None:
        self.loaded = loaded
        self.kv_cache = KVCache(loaded.kv_config, num_blocks, block_size, loaded.dtype, loaded.device)
        self.runner = ModelRunner(loaded, self.kv_cache)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.target_vocab = target_vocab
        # masks a row of draft logits with its request's grammar (request ids, drafts so far, logits); the
        # engine sets it (Grammars.mask_draft) so that constrained requests draft what their grammar allows
        self.draft_mask: Callable[[list[str], Sequence[Sequence[int]], torch.Tensor], None] | None = None
        self.device = loaded.device
        self.kv: dict[str, DraftKV] = {}  # request id -> its draft KV (requests that were proposed for)
        self.evictions = 0  # draft KV of a request dropped to make room for another's (``_grow``)

    def can_draft(self, req: Request) -> bool:
        """Whether the draft can read every token of ``req``: a draft with a smaller vocabulary
        than the target's cannot embed ids beyond its own (possible in token-id prompts, or
        sampled from the target's padding rows), so such a request is not speculated."""
        v = self.loaded.config.vocab_size
        if v >= self.target_vocab:
            return True
        kv = self._kv(req)  # only the tokens not checked before are read
        if any(t >= v for t in req.token_slice(kv.vocab_checked, req.num_tokens)):
            return False
        kv.vocab_checked = req.num_tokens
        return True

    def backlog(self, req: Request) -> int:
        kv = self._kv(req)
        return self._seq_end(req, kv) - kv.num_computed

    # the draft's own sequence for a request; a draft with another tokenizer reads a translation
    # (worker/speculative/cross_draft.py)

    def _seq_end(self, req: Request, kv: DraftKV) -> int:  # noqa: ARG002
        """Tokens in the draft's sequence for ``req``'s tokens so far."""
        return req.num_tokens

    def _seq(self, req: Request, kv: DraftKV, start: int, end: int) -> list[int]:  # noqa: ARG002
        """The draft's tokens ``[start, end)`` of that sequence."""
        return req.token_slice(start, end)

    def _seq_end_at(self, req: Request, kv: DraftKV, num_tokens: int) -> int:  # noqa: ARG002
        """Tokens in the draft's sequence for ``req``'s first ``num_tokens`` tokens."""
        return num_tokens

    def _feed(self, token: int) -> int:
        """The draft's token for a token it drafted (fed back for the next draft step)."""
        return token

    def _kv(self, req: Request) -> DraftKV:
        """``req``'s draft KV; the first time, started with its longest cached prefix."""
        kv = self.kv.get(req.request_id)
        if kv is None:
            kv = self.kv[req.request_id] = DraftKV()
            hit = self.blocks.match(kv.block_table, req.block_hashes, req.num_tokens - 1)
            self.blocks.count_lookup(req.num_tokens - 1, hit)
            kv.num_computed, kv.num_blocks_cached = hit, hit // self.blocks.block_size
        return kv

    def _offer(self, req: Request, kv: DraftKV) -> None:
        """Offer the full blocks of real tokens the draft has computed to its prefix cache."""
        kv.num_blocks_cached = self.blocks.cache_blocks(
            kv.block_table, req.block_hashes, min(kv.num_computed, req.num_tokens), kv.num_blocks_cached
        )

    def catch_up(self, reqs: Sequence[Request], ns: Sequence[int]) -> None:
        """One draft forward pass over the next ``ns[i]`` unread tokens of each request (no
        logits): the catch-up a proposal would otherwise do in one unbudgeted chunk."""
        chunks, done = [], []
        keep = {r.request_id for r in reqs}
        for r, n in zip(reqs, ns, strict=True):
            if not 1 <= n <= self.backlog(r):
                raise ValueError(f"request {r.request_id}: cannot catch up {n} of {self.backlog(r)} tokens")
            kv = self._kv(r)
            end = kv.num_computed + n
            if not self._grow(kv.block_table, end, keep):
                continue  # no room even after evicting others: it stays behind (decodes plainly) for now
            chunks.append(SequenceChunk(self._seq(r, kv, kv.num_computed, end), kv.num_computed, kv.block_table, 0))
            done.append((r, n))
        if not chunks:
            return
        self.runner.run(chunks)
        for r, n in done:
            kv = self.kv[r.request_id]
            kv.num_computed += n
            self._offer(r, kv)

    def _draw(
        self,
        logits: torch.Tensor,  # [n, draft vocab]
        reqs: Sequence[Request],
        drafts: Sequence[Sequence[int]],
        need_q: bool,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """q from draft logits padded to the target's vocabulary, and one token per row.
        ``need_q``: the verifier needs q at every drafted position of the batch (some request
        in it samples), so it is built for every row here, greedy rows included (one-hot),
        whichever rows are still drafting at this step. Otherwise, greedy rows with nothing
        to mask (no penalties, min_tokens met) take the argmax directly and q is not built.
        Constrained requests draft under their grammar (``draft_mask``, set by the engine)."""
        if self.draft_mask is not None:
            self.draft_mask([r.request_id for r in reqs], drafts, logits)
        if not need_q and all(plain_greedy(r, len(d)) for r, d in zip(reqs, drafts, strict=True)):
            return None, [int(t) for t in logits.argmax(dim=-1).tolist()]
        if logits.shape[1] < self.target_vocab:
            # a draft with a smaller (unpadded) vocabulary: the entries beyond it are impossible
            # (q = 0), and penalties may index them (prompt or output ids beyond the draft's)
            logits = torch.nn.functional.pad(logits.float(), (0, self.target_vocab - logits.shape[1]), value=-torch.inf)
        rows = [r.sampling_row(d) for r, d in zip(reqs, drafts, strict=True)]
        q = processed_probs(logits, rows)  # [n, target vocab]
        toks = sample_from_probs(q, rows, draft=True)  # greedy rows: q is one-hot, nothing is drawn
        return q, [int(t) for t in toks.tolist()]

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        """Draft ``ks[i] >= 1`` tokens for each of ``reqs``. The draft block tables must be
        able to grow (the engine sizes the draft pool so that they always can)."""
        t0 = time.perf_counter()
        n = len(reqs)
        drafts: list[list[int]] = [[] for _ in range(n)]
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
        kvs = [self._kv(r) for r in reqs]
        ends = [self._seq_end(r, kv) for r, kv in zip(reqs, kvs, strict=True)]
        keep = {r.request_id for r in reqs}
        for r, k, end, kv in zip(reqs, ks, ends, kvs, strict=True):
            if k < 1:
                raise ValueError(f"request {r.request_id}: k must be >= 1, got {k}")
            if not self._grow(kv.block_table, end + k - 1, keep):
                raise RuntimeError("draft KV pool exhausted, even after evicting the draft KV of other requests")
        chunks0 = [
            SequenceChunk(self._seq(r, kv, kv.num_computed, end), kv.num_computed, kv.block_table, 1)
            for r, end, kv in zip(reqs, ends, kvs, strict=True)
        ]
        need_q = any(not r.sampling_params.is_greedy for r in reqs)
        logits = self.runner.run(chunks0)  # [n, draft vocab]
        q, toks = self._draw(logits, reqs, drafts, need_q)
        t_first = time.perf_counter()
        for i in range(n):
            kvs[i].num_computed = ends[i]
            self._offer(reqs[i], kvs[i])  # real tokens only: drafted positions follow
            drafts[i].append(toks[i])
            if q is not None:
                q_rows[i].append(q[i])
        steps = 1
        for j in range(1, max(ks)):
            active = [i for i in range(n) if ks[i] > j]
            chunks = [
                SequenceChunk([self._feed(drafts[i][-1])], ends[i] + j - 1, kvs[i].block_table, 1) for i in active
            ]
            logits = self.runner.run(chunks)  # [len(active), draft vocab]
            q, toks = self._draw(logits, [reqs[i] for i in active], [drafts[i] for i in active], need_q)
            for row, i in enumerate(active):
                kvs[i].num_computed = ends[i] + j
                drafts[i].append(toks[row])
                if q is not None:
                    q_rows[i].append(q[row])
            steps += 1
        if need_q and any(len(rows) != k for rows, k in zip(q_rows, ks, strict=True)):
            raise RuntimeError("draft proposer: a sampling batch is missing q at a drafted position")
        probs = torch.stack([t for rows in q_rows for t in rows]) if need_q else None  # [sum k, target vocab]
        t_end = time.perf_counter()
        if max(len(c.token_ids) for c in chunks0) <= 2:
            per_step: float | None = (t_end - t0) / steps
        else:
            per_step = (t_end - t_first) / (steps - 1) if steps > 1 else None
        return Proposal(token_ids=drafts, probs=probs, seconds=t_end - t0, step_seconds=per_step, step_batch=n)

    def settle(self, req: Request, num_tokens_before: int, k: int, accepted: int) -> None:
        """After verification: keep the draft KV of the accepted prefix only."""
        kv = self.kv.get(req.request_id)
        if kv is None:
            return
        kv.num_computed = self._seq_end_at(req, kv, num_tokens_before) + min(accepted, k - 1)
        self.blocks.shrink(kv.block_table, kv.num_computed)

    def _grow(self, table: list[int], num_tokens: int, keep: set[str]) -> bool:
        """Grow ``table`` to ``num_tokens``; when the pool is short, first drop the draft KV of
        requests outside ``keep`` (largest first; they catch up again when they next draft). The
        pool has as many blocks as the target's, but it can hold more of them in use: a prompt
        prefix the target shares between requests is shared here only once the draft has computed
        and cached it, which a request behind on its catch-up has not."""
        need = self.blocks.extra_blocks(table, num_tokens)
        while self.blocks.num_free_blocks < need:
            victims = [(len(kv.block_table), rid) for rid, kv in self.kv.items() if rid not in keep and kv.block_table]
            if not victims:
                break
            _, rid = max(victims)
            self.blocks.free(self.kv.pop(rid).block_table)
            self.evictions += 1
        return self.blocks.grow(table, num_tokens)

    def release(self, req: Request) -> None:
        """Free the request's draft blocks (finished, aborted, failed or preempted)."""
        kv = self.kv.pop(req.request_id, None)
        if kv is not None:
            if req.finish_reason is not FinishReason.ERROR:
                self._offer(req, kv)
            self.blocks.free(kv.block_table)

    def check(self, reqs: Sequence[Request]) -> None:
        by_id = {r.request_id: r for r in reqs}
        stray = set(self.kv) - set(by_id)
        if stray:
            raise AssertionError(f"draft KV held for requests that are gone: {sorted(stray)}")
        self.blocks.pool.check(kv.block_table for kv in self.kv.values())
        for rid, kv in self.kv.items():
            limit = self._computable(by_id[rid], kv)
            if kv.num_computed > limit:
                raise AssertionError(f"{rid}: draft KV of {kv.num_computed} > {limit} tokens")

    def _computable(self, req: Request, kv: DraftKV) -> int:  # noqa: ARG002
        """For :meth:`check`: the most tokens the draft's KV of ``req`` may hold (its sequence's length)."""
        return req.num_tokens

    def check_idle(self) -> None:
        self.check([])
        if self.blocks.num_free_blocks != self.blocks.num_blocks:
            raise AssertionError(f"{self.blocks.num_blocks - self.blocks.num_free_blocks} draft blocks still in use")
