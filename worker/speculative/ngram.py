"""N-gram prompt-lookup proposer: draft the tokens that followed an earlier occurrence of
the sequence's own suffix (vLLM's ``[ngram]`` method; HF's ``prompt_lookup_num_tokens``).

No model and no distribution: its drafts are verified with ``draft_probs=None`` (q one-hot
at the drafted token), see :mod:`draftwise.worker.speculative.rejection_sampler`.

**Which occurrence.** Among suffixes of length ``prompt_lookup_max`` down to
``prompt_lookup_min``, the longest one that occurred earlier wins; among its earlier
occurrences we take the **most recent** one. vLLM and HF take the earliest instead. We prefer
the most recent because it reflects the current state of the text: when a piece of code or
a list is rewritten, the latest version is the one most likely to be repeated next, and a
generation caught in a loop is continued by its latest cycle. The price: the most recent
occurrence can sit close to the end of the sequence (an overlapping repeat), so fewer than
``k`` tokens may follow it, where the earliest would have offered more.

An occurrence must start strictly before the suffix itself (it may overlap it), so at least
one token always follows it: a match always proposes ``min(k, available) >= 1`` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from draftwise.worker.speculative.proposer import Proposal, Proposer

if TYPE_CHECKING:
    from draftwise.worker.core.request import Request

__all__ = ["LookupProposer", "NgramProposer"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class LookupProposer(Proposer):
    """A draftless proposer whose drafts are found by a lookup (:meth:`find`) while scheduling
    (:meth:`plan`: k is what it found) and handed over by :meth:`propose`, q one-hot."""

    def __init__(self) -> None:
        self._found: dict[str, list[int]] = {}  # request id -> drafts found by plan, until propose
        self._seconds = 0.0  # lookup time since the last proposal
        self._lookups = 0  # lookups since the last proposal

    def find(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` drafts for ``req``."""
        raise NotImplementedError

    def plan(self, req: Request, k: int) -> int:
        t0 = time.perf_counter()
        found = self.find(req, k)
        self._seconds += time.perf_counter() - t0
        self._lookups += 1
        if found:
            self._found[req.request_id] = found
        else:
            self._found.pop(req.request_id, None)
        return len(found)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> Proposal:
        drafts = []
        for r, k in zip(reqs, ks, strict=True):
            found = self._found.get(r.request_id, [])
            if len(found) < k:
                raise RuntimeError(f"{self.name} proposer: {r.request_id} was planned {k} drafts, {len(found)} found")
            drafts.append(found[:k])
        for r in reqs:  # handed over only once all were found: a batch that fails is retried request by request
            del self._found[r.request_id]
        seconds, lookups = self._seconds, self._lookups
        self._seconds, self._lookups = 0.0, 0
        # a lookup finds all of a request's drafts at once: one more drafted token costs the
        # lookups of the step spread over the deepest k
        return Proposal(
            token_ids=drafts,
            probs=None,
            seconds=seconds,
            step_seconds=seconds / max(ks),
            step_batch=max(lookups, len(reqs)),
        )

    def discard(self, req: Request) -> None:
        """Forget the drafts :meth:`plan` found for ``req`` (another proposer drafts instead)."""
        self._found.pop(req.request_id, None)

    def release(self, req: Request) -> None:
        self._found.pop(req.request_id, None)

    def reset(self, req: Request) -> None:
        """A failed batch call changed nothing: the drafts found for ``req`` stay, so that it
        is proposed for again alone (another part of the batch may be what failed)."""

    def check_idle(self) -> None:
        if self._found:
            raise AssertionError(f"{self.name} drafts kept for requests that are gone: {sorted(self._found)}")


class NgramProposer(LookupProposer):
    """Prompt lookup: :meth:`lookup` finds up to ``k`` draft tokens in a token list."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        super().__init__()
        if not _is_int(prompt_lookup_min) or prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be an integer >= 1, got {prompt_lookup_min!r}")
        if not _is_int(prompt_lookup_max) or prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be an integer >= prompt_lookup_min ({prompt_lookup_min}), "
                f"got {prompt_lookup_max!r}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        """Shortest suffix that may be matched."""
        self.prompt_lookup_max = prompt_lookup_max
        """Longest suffix tried first."""

    def find(self, req: Request, k: int) -> list[int]:
        return self.lookup(req.all_token_ids, k)

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        matching suffix (length in [prompt_lookup_min, prompt_lookup_max]) of ``token_ids``;
        ``[]`` when nothing matches or ``k == 0``.

        One backward pass: candidate occurrences are the earlier positions holding the last
        token (found by C-speed ``list.index`` on the reversed list), each extended backwards
        by at most ``prompt_lookup_max`` comparisons; the pass stops at the first (most recent)
        occurrence of full length. O(len * prompt_lookup_max) worst case, no extra structures.
        """
        if not _is_int(k) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        toks = token_ids if isinstance(token_ids, list) else list(token_ids)  # read only: no copy of a list
        n = len(toks)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if k == 0 or n < lo + 1:  # a suffix of length lo plus an earlier occurrence of its last token
            return []
        rev = toks[::-1]  # rev[m] == toks[n - 1 - m]
        last = rev[0]
        best_len, best_end = 0, -1  # best_end: index in toks of the matched occurrence's last token
        j = 1
        while True:
            try:
                j = rev.index(last, j)  # the next earlier position holding the last token
            except ValueError:
                break
            # Length of the common suffix of toks[:n - j] and toks, capped at hi; the occurrence
            # cannot extend past the start of the sequence.
            cap = min(hi, n - j)
            m = 1
            while m < cap and rev[j + m] == rev[m]:
                m += 1
            if m > best_len:  # strictly longer only: among equal lengths the most recent stays
                best_len, best_end = m, n - 1 - j
                if m == hi:
                    break
            j += 1
        if best_len < lo:
            return []
        return toks[best_end + 1 : best_end + 1 + k]
