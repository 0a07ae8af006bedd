"""A draft model with another tokenizer than the target's (docs/engine.md, "Drafts with another
tokenizer"): the draft-model proposer reading each request in its own tokens, through a
:class:`~draftwise.worker.speculative.vocab_bridge.VocabBridge`.

Per request it keeps the translation of the request's tokens into draft tokens (:class:`CrossKV`:
the tokens it had when first met, encoded as one text by the draft's tokenizer, then each
later token on its own, with the draft length after each), and the draft KV of a prefix of that
translation, exactly as the draft-model proposer keeps its KV of a prefix of the request:
catch-up, budgets, eviction and release are the same, in draft tokens. Then, per the bridge's mode:

- **TLI**: each draft step's logits are moved onto the target's vocabulary (the intersection's
  entries; everything else impossible) before the request's sampling parameters shape them, so
  a drafted token is a target token with its q, verified like any draft model's; the draft is
  fed the shared token's draft id, so an accepted draft's KV stays (a shared target token
  translates to exactly that id).
- **SLEM**: the draft writes greedily in its own tokens, about 1.5 per target token wanted;
  the text is tokenized again for the target (its last token dropped unless the draft ended
  its text) and proposed with q one-hot, as lookup drafts are (shorter than planned: padded by
  repeating the last draft, which the verifier simply rejects). After verification the draft
  keeps only the KV of the request's real tokens (the accepted text is read again, translated).

Prefix caching does not reach the draft's pool here (the target's block hashes are over target
tokens); a request whose translation would outgrow the draft's context stops speculating.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draftwise.worker.core.request import Request
from draftwise.worker.model.loader import LoadedModel
from draftwise.worker.model.model_runner import SequenceChunk
from draftwise.worker.speculative.draft import DraftKV, DraftModelProposer
from draftwise.worker.speculative.proposer import Proposal
from draftwise.worker.speculative.vocab_bridge import VocabBridge

__all__ = ["CROSS_POOL_SCALE", "CrossKV", "CrossVocabProposer"]

CROSS_POOL_SCALE = 2
"""The draft's pool holds this many times the target's blocks: a text may take more of the
draft's tokens than of the target's (counted in the KV budget, engine sizing)."""

SLEM_STEPS_PER_TOKEN = 1.5
"""SLEM draft steps per target token wanted (a smaller vocabulary writes more, shorter tokens)."""


@dataclass
class CrossKV(DraftKV):
    """A request's draft KV, and the draft's tokens for the request's tokens."""

    tokens: list[int] = field(default_factory=list)  # the translation, in draft ids
    base: int = 0  # the request's tokens translated as one text (when first met)
    base_len: int = 0  # draft tokens for them
    ends: list[int] = field(default_factory=list)  # per later request token: the translation's length after it


class CrossVocabProposer(DraftModelProposer):
    """The draft-model proposer for a draft with another tokenizer (TLI or SLEM); its vocabulary
    may be larger than the target's."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, bridge: VocabBridge) -> None:
        super().__init__(loaded, num_blocks, block_size, bridge.target_vocab, prefix_caching=False)
        self.bridge = bridge
        self.mode = bridge.mode
        self.max_len = loaded.config.max_position_embeddings
        shared = bridge.shared_draft_ids
        self._from, self._to = shared.to(self.device), bridge.to_target[shared].to(self.device)  # TLI's moves
        # a whole accepted round, translated (about 1.3 draft tokens a target token), is read in
        # the proposal's first pass
        self.inline_backlog = 12

    # ------------------------------------------------------------------ the translation

    def _kv(self, req: Request) -> CrossKV:
        kv = self.kv.get(req.request_id)
        if kv is None:
            ids = req.token_slice(0, req.num_tokens)
            toks = self.bridge.translate_text(ids)
            kv = self.kv[req.request_id] = CrossKV(tokens=toks, base=len(ids), base_len=len(toks))
        assert isinstance(kv, CrossKV)
        return kv

    def _translated(self, req: Request, kv: CrossKV) -> None:
        """Translate the request's tokens the draft has not translated yet."""
        for t in req.token_slice(kv.base + len(kv.ends), req.num_tokens):
            kv.tokens.extend(self.bridge.translate(t))
            kv.ends.append(len(kv.tokens))

    def _seq_end(self, req: Request, kv: DraftKV) -> int:
        assert isinstance(kv, CrossKV)
        self._translated(req, kv)
        return len(kv.tokens)

    def _seq(self, req: Request, kv: DraftKV, start: int, end: int) -> list[int]:
        assert isinstance(kv, CrossKV)
        self._translated(req, kv)
        return kv.tokens[start:end]

    def _seq_end_at(self, req: Request, kv: DraftKV, num_tokens: int) -> int:  # noqa: ARG002
        assert isinstance(kv, CrossKV)
        if num_tokens < kv.base:
            raise ValueError(f"cannot roll back to {num_tokens} tokens, before the {kv.base} read as one text")
        return kv.base_len if num_tokens == kv.base else kv.ends[num_tokens - kv.base - 1]

    def _feed(self, token: int) -> int:
        d = self.bridge.to_draft.get(token)  # a TLI draft is always shared: q is zero outside
        return d if d is not None else (self.bridge.translate(token) or [0])[0]

    def _offer(self, req: Request, kv: DraftKV) -> None:
        """The draft's pool caches nothing here (its blocks hold draft tokens, not the target's)."""

    def can_draft(self, req: Request) -> bool:
        """Whether the request's translation still fits in the draft's context with room to draft."""
        return self._seq_end(req, self._kv(req)) + 2 * self.inline_backlog < self.max_len

    # ------------------------------------------------------------------ drafting

    def _draw(
        self, logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[Sequence[int]], need_q: bool
    ) -> tuple[torch.Tensor | None, list[int]]:
        """TLI: the draft's logits on the target's vocabulary, the intersection alone possible."""
        moved = logits.new_full((logits.shape[0], self.target_vocab), -torch.inf, dtype=torch.float32)
        moved[:, self._to] = logits[:, self._from].float()
        return super()._draw(moved, reqs, drafts, need_q)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        if self.mode == "tli":
            return super().propose(reqs, ks)
        return self._propose_text(reqs, ks)

    def _propose_text(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        """SLEM: greedy draft text for each request, tokenized again for the target."""
        t0 = time.perf_counter()
        n = len(reqs)
        kvs = [self._kv(r) for r in reqs]
        ends = [self._seq_end(r, kv) for r, kv in zip(reqs, kvs, strict=True)]
        steps = [math.ceil(SLEM_STEPS_PER_TOKEN * k) + 1 for k in ks]
        keep = {r.request_id for r in reqs}
        for r, k, end, kv, m in zip(reqs, ks, ends, kvs, steps, strict=True):
            if k < 1:
                raise ValueError(f"request {r.request_id}: k must be >= 1, got {k}")
            if not self._grow(kv.block_table, end + m - 1, keep):
                raise RuntimeError("draft KV pool exhausted, even after evicting the draft KV of other requests")
        eos = set(self.loaded.config.eos_token_ids)
        written: list[list[int]] = [[] for _ in range(n)]
        ended = [False] * n
        chunks = [
            SequenceChunk(self._seq(r, kv, kv.num_computed, end), kv.num_computed, kv.block_table, 1)
            for r, end, kv in zip(reqs, ends, kvs, strict=True)
        ]
        active = list(range(n))
        for j in range(max(steps)):
            if j:
                chunks = [SequenceChunk([written[i][-1]], ends[i] + j - 1, kvs[i].block_table, 1) for i in active]
            toks = self.runner.run(chunks).argmax(dim=-1).tolist()
            for i, t in zip(active, toks, strict=True):
                kvs[i].num_computed = ends[i] + j
                if t in eos:
                    ended[i] = True
                else:
                    written[i].append(int(t))
            active = [i for i in active if not ended[i] and len(written[i]) < steps[i]]
            if not active:
                break
        drafts = []
        for i, k in enumerate(ks):
            got = self.bridge.retokenize(written[i], complete=ended[i])[:k]
            drafts.append(got + [got[-1] if got else 0] * (k - len(got)))
        seconds = time.perf_counter() - t0
        return Proposal(drafts, None, seconds, seconds / max(ks), n)

    def settle(self, req: Request, num_tokens_before: int, k: int, accepted: int) -> None:
        """TLI keeps the accepted drafts' KV; SLEM keeps the KV of the tokens before the round."""
        if self.mode == "tli":
            super().settle(req, num_tokens_before, k, accepted)
            return
        kv = self.kv.get(req.request_id)
        if kv is not None:
            kv.num_computed = min(kv.num_computed, self._seq_end_at(req, kv, num_tokens_before))
            self.blocks.shrink(kv.block_table, kv.num_computed)

    def _computable(self, req: Request, kv: DraftKV) -> int:
        """The translation's length, the accepted drafts (translated lazily, when next read) included."""
        assert isinstance(kv, CrossKV)
        if kv.base + len(kv.ends) > req.num_tokens:
            raise AssertionError(f"{req.request_id}: {kv.base + len(kv.ends)} tokens translated of {req.num_tokens}")
        untranslated = req.token_slice(kv.base + len(kv.ends), req.num_tokens)
        return len(kv.tokens) + sum(len(self.bridge.translate(t)) for t in untranslated)
