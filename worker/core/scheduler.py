"""Token-budget scheduling (docs/engine.md, "Scheduling").

Every request asks, each step, for the tokens it still has to compute: a chunk of its
prompt, the one token it sampled last step, or (after a preemption) everything again. The
scheduler serves running requests first, oldest first, then admits waiting ones first come,
first served, within ``max_num_batched_tokens`` and ``max_num_seqs``. When blocks run out,
the newest running request gives its blocks back and goes to the front of the queue, to be
recomputed later: nothing is lost.

With speculative decoding, a running request in decode (one uncomputed token) may also be
given ``k`` draft positions to verify: ``draft_k`` (planned before scheduling) says how many it
wants; they count in the token budget and in the request's blocks, and are dropped rather
than preempting anyone when blocks are short.

The scheduler is the one writer of a request's progress: ``num_computed_tokens`` moves here
(:meth:`Scheduler.update_from_output` after each step, back to 0 on preemption), and so do the
request's blocks (grown when scheduled, shrunk when drafts are rejected, freed when it leaves).

With prefix caching, a request being admitted starts with the longest cached prefix of its
tokens (all but the last, so that a logit is computed), its prefill after it; the full blocks a
step has computed are offered to the cache in :meth:`Scheduler.update_from_output`, and once
more when a request is preempted or leaves (a failed request's are not: its KV is suspect).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from draftwise.worker.core.block_manager import BlockManager, chain_hashes
from draftwise.worker.core.request import FinishReason, Request, RequestStatus

log = structlog.get_logger("draftwise.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits."""

    max_num_seqs: int = 128  # requests in one step
    max_num_batched_tokens: int = 2048  # tokens in one step
    enable_chunked_prefill: bool = True  # split prompts across steps to fit the token budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, from request.num_computed_tokens on (drafts included)
    num_draft_tokens: int = 0  # of which draft tokens to verify (speculative decoding)

    @property
    def samples(self) -> bool:
        """This step reaches the end of the sequence, so it yields logits for a new token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to the queue

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and free its blocks (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.finish_reason is not FinishReason.ERROR:
            self._cache(req)
        self.blocks.free(req.block_table)

    def schedule(self, draft_k: Mapping[str, int] | None = None) -> SchedulerOutput:
        """The next step's batch: running requests first (oldest first), then waiting ones
        (first come, first served), then draft positions for decoding requests with what budget
        is left. ``draft_k``: request id -> draft tokens a decoding request wants verified this
        step (speculative decoding)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            if not self._reserve(req, n, out):
                break  # req itself was preempted: it was the newest, nothing follows it
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is short: admit nobody this step, and grant no drafts
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self._match(req)
            n = req.num_uncomputed_tokens
            if (not self.config.enable_chunked_prefill and n > budget) or not self.blocks.grow(
                req.block_table, req.num_computed_tokens + min(n, budget)
            ):
                self._unmatch(req)
                break
            n = min(n, budget)
            self.blocks.count_lookup(req.num_tokens - 1, hit)
            if not req.num_preemptions:
                req.num_cached_tokens = min(hit, req.num_prompt_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        # drafts last: a waiting request's prompt is work the client is owed, a draft only a guess
        if draft_k and budget > 0:
            self._add_drafts(out, budget, draft_k)
        return out

    def update_from_output(self, scheduled: list[ScheduledRequest], accepted: Mapping[str, int]) -> None:
        """After a step's tokens are sampled or verified: each scheduled request that is still
        unfinished has computed what it was scheduled (a verifying request: its last token and
        ``accepted[id]`` drafts), and a verifying request gives back the blocks of its rejected
        positions. Call before the new tokens are appended (``samples`` reads the old state)."""
        for s in scheduled:
            r = s.request
            if r.is_finished:
                continue
            if not s.num_draft_tokens:
                r.num_computed_tokens += s.num_new_tokens
            else:
                r.num_computed_tokens += 1 + accepted[r.request_id]  # the last one emitted is new
                self.blocks.shrink(r.block_table, r.num_computed_tokens + 1)
            self._cache(r)

    # ------------------------------------------------------------------ prefix cache

    def _hashes(self, req: Request) -> list[bytes]:
        """The hashes of ``req``'s full blocks, extended to its tokens as they stand."""
        bs, have = self.blocks.block_size, len(req.block_hashes)
        if req.num_tokens // bs > have:
            chain_hashes(req.token_slice(have * bs, req.num_tokens), bs, req.cache_salt, req.block_hashes)
        return req.block_hashes

    def _match(self, req: Request) -> int:
        """Start a request being admitted (nothing computed) with its cached prefix."""
        if not self.blocks.enable_prefix_caching or req.num_computed_tokens:
            return 0
        hit = self.blocks.match(req.block_table, self._hashes(req), req.num_tokens - 1)
        req.num_computed_tokens = req.prefill_start = hit
        req.num_blocks_cached = hit // self.blocks.block_size
        return hit

    def _unmatch(self, req: Request) -> None:
        """``req`` is not admitted after all: its cached blocks go back."""
        self.blocks.free(req.block_table)
        req.num_computed_tokens = req.prefill_start = req.num_blocks_cached = 0

    def _cache(self, req: Request) -> None:
        """Offer ``req``'s newly computed full blocks (their tokens known) to the cache."""
        if self.blocks.enable_prefix_caching:
            done = min(req.num_computed_tokens, req.num_tokens)
            req.num_blocks_cached = self.blocks.cache_blocks(
                req.block_table, self._hashes(req), done, req.num_blocks_cached
            )

    def _add_drafts(self, out: SchedulerOutput, budget: int, draft_k: Mapping[str, int]) -> None:
        """Give decoding requests their draft positions, oldest first, while budget and free
        blocks last (drafts never preempt anyone)."""
        for idx, s in enumerate(out.scheduled):
            if budget <= 0:
                break
            req = s.request
            if s.num_new_tokens != 1 or req.num_uncomputed_tokens != 1:
                continue
            k = min(draft_k.get(req.request_id, 0), budget)
            if k > 0 and self.blocks.grow(req.block_table, req.num_computed_tokens + 1 + k):
                out.scheduled[idx] = ScheduledRequest(req, 1 + k, k)
                budget -= k

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Grow ``req``'s blocks for ``n`` more tokens, preempting the newest running
        requests as needed. False when ``req`` itself had to be preempted."""
        while not self.blocks.grow(req.block_table, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._cache(req)  # found again when it comes back, unless evicted by then
        self.blocks.free(req.block_table)
        req.num_computed_tokens = req.prefill_start = req.num_blocks_cached = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        log.info("preempted", request_id=req.request_id, tokens=req.num_tokens, free_blocks=self.blocks.num_free_blocks)
