"""Suffix proposer: draft what followed the longest match of a request's suffix, in the
request's own tokens or in the outputs of earlier requests of the same tenant (suffix
decoding, SuffixDecoding / vLLM ``method="suffix"``; the seed article's "cache for
high-frequency token sequences").

Like n-gram lookup it has no model and no distribution: its drafts are verified with q
one-hot at the drafted token, so exact rejection sampling and the seeded coupling apply
unchanged. Unlike it, it also looks across requests, and its lookups cost O(1) per request
and step whatever the context length:

- **The cache** (:class:`SuffixCache`): finished requests' outputs (with the last few tokens
  of their prompts, so that an output's first tokens can be matched), per tenant: every
  entry is keyed with the request's cache salt (``Request.cache_salt``, per API key from the
  gateway), so one tenant's outputs are never proposed to, and never leak by timing to,
  another. Indexed by their ``CONTEXT``-token windows (the most recent ``MAX_OCCURRENCES``
  occurrences of each), bounded by ``max_tokens`` tokens, the oldest output dropped first.
- **The request's own tokens** (:class:`_Own`): the same index over prompt + output, kept up
  to date incrementally (one window per new token), most recent occurrence only.
- **A lookup** takes the windows ending the request's tokens, extends each candidate
  occurrence backwards to measure how deep the match goes (up to ``MAX_DEPTH``), and drafts
  the tokens that followed the deepest one (ties: the request's own, then the most recent):
  at most ``k``, and at most as many as the match is deep (a short match is a weak promise:
  SuffixDecoding's match-length-scaled speculation). Matches shallower than ``min_depth``
  propose nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftwise.worker.core.request import FinishReason
from draftwise.worker.speculative.ngram import LookupProposer

if TYPE_CHECKING:
    from draftwise.worker.core.request import Request

__all__ = ["DEFAULT_MAX_TOKENS", "SuffixCache", "SuffixProposer"]

CONTEXT = 3  # tokens an occurrence is indexed by
MAX_OCCURRENCES = 16  # occurrences kept per window in the cache (the most recent)
MAX_DEPTH = 32  # how far back a match is measured
PROMPT_TAIL = 16  # prompt tokens stored before an output
DEFAULT_MAX_TOKENS = 200_000


@dataclass
class _Entry:
    salt: str
    tokens: list[int]


class SuffixCache:
    """Earlier outputs, per tenant salt, indexed by their windows; at most ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._index: dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]] = {}  # -> [(entry, next position)]
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, salt: str, tokens: Sequence[int]) -> None:
        toks = list(tokens[-self.max_tokens :])
        if len(toks) <= CONTEXT:
            return
        eid, self._next = self._next, self._next + 1
        self._entries[eid] = _Entry(salt, toks)
        for i in range(CONTEXT, len(toks)):
            occ = self._index.setdefault((salt, tuple(toks[i - CONTEXT : i])), [])
            occ.append((eid, i))
            if len(occ) > MAX_OCCURRENCES:
                del occ[0]
        self.num_tokens += len(toks)
        while self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        eid, e = self._entries.popitem(last=False)
        for i in range(CONTEXT, len(e.tokens)):
            key = (e.salt, tuple(e.tokens[i - CONTEXT : i]))
            occ = self._index.get(key)
            if occ is None:
                continue
            occ[:] = [o for o in occ if o[0] != eid]
            if not occ:
                del self._index[key]
        self.num_tokens -= len(e.tokens)

    def match(self, salt: str, context: Sequence[int]) -> tuple[int, list[int], int]:
        """The deepest match of ``context``'s end among this tenant's entries: (depth, the
        entry's tokens, the position after the match); depth 0 when there is none."""
        if len(context) < CONTEXT:
            return 0, [], 0
        best: tuple[int, list[int], int] = (0, [], 0)
        for eid, pos in reversed(self._index.get((salt, tuple(context[-CONTEXT:])), ())):
            toks = self._entries[eid].tokens
            d = _depth(toks, pos, context)
            if d > best[0]:
                best = (d, toks, pos)
        return best

    def check(self) -> None:
        if self.num_tokens != sum(len(e.tokens) for e in self._entries.values()) or self.num_tokens > self.max_tokens:
            raise AssertionError(f"suffix cache holds {self.num_tokens} tokens (budget {self.max_tokens})")
        for occ in self._index.values():
            if not occ or any(eid not in self._entries for eid, _ in occ):
                raise AssertionError("suffix cache index points at a dropped entry")


def _depth(toks: Sequence[int], pos: int, context: Sequence[int]) -> int:
    """How many tokens before ``toks[pos]`` equal the end of ``context`` (at most MAX_DEPTH)."""
    d, n = 0, len(context)
    while d < MAX_DEPTH and d < pos and d < n and toks[pos - 1 - d] == context[n - 1 - d]:
        d += 1
    return d


@dataclass
class _Own:
    """One request's own windows: window -> the position after its most recent occurrence."""

    last: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = CONTEXT  # windows ending before this position are in ``last``


class SuffixProposer(LookupProposer):
    """Drafts from the suffix cache and the request's own tokens; the lookup runs while
    scheduling (:meth:`plan`: k is what it found), :meth:`propose` hands the drafts over."""

    name = "suffix"

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, min_depth: int = 4) -> None:
        super().__init__()
        self.cache = SuffixCache(max_tokens)
        self.min_depth = min_depth
        self._own: dict[str, _Own] = {}

    def lookup(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` drafts for ``req`` (see the module doc). Reads only the tokens added
        since the last lookup and the last ``MAX_DEPTH``: O(1) per step in the context length."""
        n = req.num_tokens
        own = self._own.setdefault(req.request_id, _Own())
        if n > own.indexed:
            base = own.indexed - CONTEXT
            new = req.token_slice(base, n)
            for i in range(own.indexed, n):  # windows whose next token exists
                own.last[tuple(new[i - CONTEXT - base : i - base])] = i
            own.indexed = n
        tail = req.token_slice(max(0, n - MAX_DEPTH), n)
        if len(tail) < CONTEXT:
            return []
        depth, drafts = 0, []
        p = own.last.get(tuple(tail[-CONTEXT:]))
        if p is not None:
            before = req.token_slice(max(0, p - MAX_DEPTH), p)
            depth = _depth(before, len(before), tail)
            drafts = req.token_slice(p, min(n, p + min(k, depth)))
        d, cached, pos = self.cache.match(req.cache_salt, tail)
        if d > depth:
            depth, drafts = d, cached[pos : pos + min(k, d)]
        return list(drafts) if depth >= self.min_depth else []

    def find(self, req: Request, k: int) -> list[int]:
        return self.lookup(req, k)

    def release(self, req: Request) -> None:
        """A request that finished normally leaves its output in the cache (its tenant's)."""
        super().release(req)
        self._own.pop(req.request_id, None)
        if req.is_finished and req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and req.output_token_ids:
            self.cache.add(req.cache_salt, req.prompt_token_ids[-PROMPT_TAIL:] + req.output_token_ids)

    def check(self, reqs: Sequence[Request]) -> None:
        stray = set(self._own) - {r.request_id for r in reqs}
        if stray:
            raise AssertionError(f"suffix state kept for requests that are gone: {sorted(stray)}")
        self.cache.check()

    def check_idle(self) -> None:
        self.check([])
        super().check_idle()
