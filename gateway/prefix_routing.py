"""Cache-aware routing: a prompt goes to the worker that already holds its prefix's KV.

The gateway does not tokenize, so it cannot know which KV blocks a worker holds. It keys each
request instead by :func:`route_key`: its cache salt, its model and the first
``prefix_routing_bytes`` of a canonical rendering of its prompt (the text's bytes; token ids as
4 little-endian bytes each; chat messages as role and content, in order), and remembers which
worker ran each key (:class:`PrefixRouting`, a bounded table, least recently used forgotten
first). Requests that share a long prefix (a system prompt, few-shot examples, a conversation
that grows by one turn at a time) share the key, so they land where that prefix was computed,
and the worker's prefix cache finds it there.

The policy (:meth:`PrefixRouting.choose`), with bounded load so that one hot prefix cannot
overload one worker (consistent hashing with bounded loads, Mirrokni et al. 2018):

- a new key goes to the least-loaded worker: fewest of this gateway's requests in flight, then
  fewest keys assigned (so that distinct prefixes spread evenly: the keys a worker holds are the
  load it will get), then fewest queued at the worker, then the least KV in use (both as of the
  last poll, up to half a second old, which is why they come after the keys); it becomes the
  key's worker (``new``);
- a known key goes to its worker (``hit``) unless that worker would then run more than
  ``ceil(LOAD_BOUND x mean)`` requests, the mean taken over the healthy workers of the model
  with this request counted, and more than ``SPILL_GAP`` more than the least-loaded other one:
  then it spills to the least-loaded other worker (``spill``), and the key stays with its worker;
- when the key's worker is gone, unhealthy or draining, the request goes to the least-loaded
  worker, which becomes the key's worker (``fallback``); when it is only excluded (a failover
  never goes back to the worker that failed the request), the request goes elsewhere and the
  key stays (``fallback`` too).

A worker that restarted (its ``worker_started_at`` changed: its cache is gone) or was retired
loses its keys (:meth:`PrefixRouting.observe_start`, :meth:`PrefixRouting.forget`); they go to
whichever worker takes them next. Collisions of keys only make a routing choice worse, never
share KV: isolation is the workers' (their block hashes are salted with the cache salt).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

import structlog

from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.metrics import GatewayMetrics
from draftwise.v1 import generation_pb2 as pb

log = structlog.get_logger("draftwise.gateway.prefix_routing")

LOAD_BOUND = 1.25
"""A key's worker takes its requests while it would run at most ``ceil(LOAD_BOUND x mean)``..."""
SPILL_GAP = 4
"""... or at most ``SPILL_GAP`` more than the least-loaded other worker: at a few requests in flight a
relative bound alone spills on noise (5 of 8 on one of 2 workers), and each spill computes the
prefix again elsewhere (SGLang's router has such an absolute threshold too)."""
KEY_BYTES = 16
"""Size of a route key (a BLAKE2b digest)."""


class Routable(Protocol):
    """What the policy reads of a worker (a :class:`~draftwise.gateway.router.WorkerHandle`)."""

    name: str
    in_flight: int

    def score(self) -> tuple[int, int, float]: ...


W = TypeVar("W", bound=Routable)


def prompt_prefix(prompt: pb.Prompt, limit: int) -> bytes:
    """The first ``limit`` bytes of the canonical rendering of ``prompt`` (see the module doc)."""
    kind = prompt.WhichOneof("kind")
    if kind == "text":
        return b"t" + prompt.text[:limit].encode("utf-8", "surrogatepass")[:limit]
    if kind == "token_ids":
        ids = prompt.token_ids.ids[: (limit + 3) // 4]
        return b"i" + struct.pack(f"<{len(ids)}I", *ids)[:limit]
    if kind == "chat":
        out = bytearray(b"c")
        for m in prompt.chat.messages:
            for part in (m.role, m.content):
                data = part[:limit].encode("utf-8", "surrogatepass")
                out += len(data).to_bytes(4, "little") + data
            if len(out) > limit:
                break
        return bytes(out[: limit + 1])
    return b""


def route_key(config: GatewayConfig, salt: str, model: str, prompt: pb.Prompt) -> bytes | None:
    """The key of a request for cache-aware routing; None when the gateway routes by load alone."""
    if config.routing != "prefix":
        return None
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (salt.encode(), model.encode()):
        h.update(len(part).to_bytes(4, "little") + part)
    h.update(prompt_prefix(prompt, config.prefix_routing_bytes))
    return h.digest()


class PrefixRouting:
    """Route key -> the name of the worker that holds its prefix, at most ``max_keys`` of them."""

    def __init__(self, max_keys: int, metrics: GatewayMetrics) -> None:
        self.max_keys = max_keys
        self.metrics = metrics
        self._owners: OrderedDict[bytes, str] = OrderedDict()  # least recently used first
        self._keys: Counter[str] = Counter()  # keys per worker name
        self._started: dict[str, float] = {}  # worker name -> its worker_started_at
        self._tiebreak = itertools.count()
        owners = self._owners
        metrics.routing_keys.set_function(lambda: len(owners))

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, key: bytes) -> str | None:
        """The name of ``key``'s worker (None: unknown); does not count as a use."""
        return self._owners.get(key)

    def keys_of(self, name: str) -> int:
        """Keys assigned to worker ``name``."""
        return self._keys[name]

    def choose(self, key: bytes, pool: Sequence[W], candidates: Sequence[W]) -> W:
        """The worker for a request keyed ``key``. ``pool``: the healthy workers of its model;
        ``candidates``: those it may go to (``pool`` without the workers that failed it),
        not empty."""
        name = self._owners.get(key)
        if name is None:
            w = self.least_loaded(candidates)
            self._assign(key, w.name)
            return self._decided(w, "new")
        self._owners.move_to_end(key)
        owner = next((x for x in pool if x.name == name), None)
        if owner is not None and owner in candidates:
            if len(candidates) == 1 or not over_bound(owner, pool):
                return self._decided(owner, "hit")
            return self._decided(self.least_loaded([x for x in candidates if x is not owner]), "spill")
        w = self.least_loaded([x for x in candidates if x is not owner])
        if owner is None:  # gone, unhealthy or draining: its cache is no use now
            self._assign(key, w.name)
        return self._decided(w, "fallback")

    def least_loaded(self, workers: Sequence[W]) -> W:
        """The least-loaded of ``workers`` (see the module doc), ties taken in turn."""

        def order(w: W) -> tuple[int, int, int, float]:
            in_flight, waiting, kv_used = w.score()
            return in_flight, self._keys[w.name], waiting, kv_used

        best = min(order(w) for w in workers)
        tied = [w for w in workers if order(w) == best]
        return tied[next(self._tiebreak) % len(tied)]

    def observe_start(self, name: str, started_at: float) -> int:
        """Worker ``name`` reports it started at ``started_at`` (unix seconds; 0: unknown): when
        that changed, it restarted and lost its cache, and so its keys. The keys dropped."""
        if started_at <= 0:
            return 0
        before = self._started.get(name)
        self._started[name] = started_at
        if before is None or before == started_at:
            return 0
        return self.forget(name, "restart")

    def forget(self, name: str, reason: str) -> int:
        """Drop the keys of worker ``name`` (``reason``: restart, retired); how many there were."""
        mine = [k for k, owner in self._owners.items() if owner == name]
        for k in mine:
            del self._owners[k]
        self._keys.pop(name, None)
        if reason == "retired":
            self._started.pop(name, None)
        if mine:
            self.metrics.routing_keys_dropped.labels(reason).inc(len(mine))
            log.info("prefix routes dropped", worker=name, reason=reason, keys=len(mine))
        return len(mine)

    def _assign(self, key: bytes, name: str) -> None:
        before = self._owners.get(key)
        if before is not None:
            self._keys[before] -= 1
        self._owners[key] = name
        self._owners.move_to_end(key)
        self._keys[name] += 1
        evicted = 0
        while len(self._owners) > self.max_keys:
            _, old = self._owners.popitem(last=False)
            self._keys[old] -= 1
            evicted += 1
        if evicted:
            self.metrics.routing_keys_dropped.labels("evicted").inc(evicted)

    def _decided(self, w: W, outcome: str) -> W:
        self.metrics.routing_decisions.labels(outcome).inc()
        return w


def over_bound(w: Routable, pool: Sequence[Routable]) -> bool:
    """Whether ``w`` would run more than ``ceil(LOAD_BOUND x mean)`` of this gateway's requests
    with one more, the mean over ``pool`` with that request counted, and more than ``SPILL_GAP``
    more than the least-loaded other worker of ``pool``."""
    total = sum(x.in_flight for x in pool) + 1
    others = [x.in_flight for x in pool if x is not w]
    gap = w.in_flight + 1 - min(others, default=0)
    return w.in_flight + 1 > math.ceil(LOAD_BOUND * total / len(pool)) and gap > SPILL_GAP
