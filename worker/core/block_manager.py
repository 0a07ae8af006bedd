"""KV blocks: a ref-counted pool with a free list, the per-request block tables built on it,
and the prefix cache. Pure Python, testable without a model.

**Prefix caching** (docs/engine.md, "Prefix caching"): a *full* block of a sequence is
identified by a hash chained over its tokens and its predecessor's hash, rooted in the
request's cache salt (one per tenant), so equal hashes mean equal tokens from the start of the
sequence on, for the same tenant. Once the KV of a full block is computed, the pool remembers
the block under that hash. A new request looks its blocks' hashes up in order and takes a
reference on the longest run it finds (:meth:`BlockManager.match`): its prefill starts after
them. A block whose last reference goes stays cached and *free*: it counts as free for
admission, and the pool hands it out again (forgetting its hash) only when no never-cached
block is left, least recently freed first. A request's blocks are freed tail first, so a
sequence's later blocks go before its prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from draftwise.worker.model.block_tables import BlockTable, truncate_table

__all__ = [
    "BlockManager",
    "BlockPool",
    "BlockPoolExhausted",
    "BlockTable",
    "PrefixCacheStats",
    "chain_hashes",
]


class BlockPoolExhausted(RuntimeError):
    """No free block (callers check ``num_free`` first; this is a bug guard)."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's counters over the engine's lifetime (zeros when it is off)."""

    queries: int = 0  # tokens looked up (each admission of a request looks up all of its tokens)
    hits: int = 0  # of which found in the cache
    cached_blocks: int = 0  # blocks a hash can find now, in use or free


def chain_hashes(tokens: Sequence[int], block_size: int, salt: str, hashes: list[bytes]) -> list[bytes]:
    """Append to ``hashes`` (those of a sequence's first ``len(hashes)`` full blocks) the hash
    of every full block of ``tokens``, the sequence's tokens from block ``len(hashes)`` on;
    returns ``hashes``. Each hash chains its predecessor's (the first: the salt's)."""
    parent = hashes[-1] if hashes else hashlib.blake2b(b"draftwise-prefix\0" + salt.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("I", tokens[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """``num_blocks`` blocks, each with a reference count. Free blocks are either never cached
    (a FIFO) or cached (findable by hash, least recently freed first); allocation takes the
    former first and evicts the latter only when it must."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached, oldest first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each, no hash)."""
        if n > self.num_free:
            raise BlockPoolExhausted(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.num_evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks already in use (a second owner)."""
        for b in blocks:
            if self._ref[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block with none left becomes free (cached
        blocks stay findable until evicted)."""
        for b in blocks:
            if self._ref[b] < 1:
                raise ValueError(f"block {b} released more often than taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def cache(self, block: int, h: bytes) -> None:
        """``block`` (in use) holds the computed KV of the full block whose hash is ``h``:
        make it findable. When another block already holds ``h`` (two requests computed
        the same prefix at once) this one stays uncached."""
        if self._ref[block] < 1:
            raise ValueError(f"block {block} is free and cannot be cached")
        if block in self._hash_of or h in self._by_hash:
            return
        self._hash_of[block] = h
        self._by_hash[h] = block

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def touch(self, block: int) -> None:
        """Take a reference on a cached block, free or in use."""
        if block not in self._hash_of:
            raise ValueError(f"block {block} is not cached")
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def check(self, owners: Iterable[Iterable[int]]) -> None:
        """Assert the pool's invariants against the block tables that own blocks: every
        reference is accounted for by an owner, no block is both free and owned, a block is
        in at most one free list, cached blocks and hashes map one to one."""
        counts = [0] * self.num_blocks
        for table in owners:
            for b in table:
                counts[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free list twice")
        if free & self._evictable.keys():
            raise AssertionError("a block is both cached-free and never-cached-free")
        free |= self._evictable.keys()
        if len(self._by_hash) != len(self._hash_of) or any(self._by_hash[h] != b for b, h in self._hash_of.items()):
            raise AssertionError("cached blocks and their hashes do not map one to one")
        for b in self._evictable:
            if b not in self._hash_of:
                raise AssertionError(f"block {b} is in the cached free list without a hash")
        for b in range(self.num_blocks):
            if counts[b] != self._ref[b]:
                raise AssertionError(f"block {b}: ref count {self._ref[b]}, owned {counts[b]} times")
            if (b in free) != (self._ref[b] == 0):
                raise AssertionError(f"block {b}: ref count {self._ref[b]} but free={b in free}")


class BlockManager:
    """Grows and frees block tables (lists of block ids, :class:`BlockTable` in the engine) for
    token counts. Tables change only here, at their tail, so the model runner's device copy
    of each is updated with the changed entries alone. With ``enable_prefix_caching``, full
    blocks are cached (:meth:`cache_blocks`) and found again (:meth:`match`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queries = 0  # tokens looked up
        self.num_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.num_queries, self.num_hits, self.pool.num_cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, table: list[int], num_tokens: int) -> int:
        """Blocks ``table`` still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` in place to hold ``num_tokens`` tokens; False (table unchanged)
        when there are not enough free blocks."""
        need = self.extra_blocks(table, num_tokens)
        if need > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(need))
        return True

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks of ``table`` beyond those holding ``num_tokens`` tokens."""
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self.pool.release(reversed(table[keep:]))
            truncate_table(table, keep)

    def free(self, table: list[int]) -> None:
        """Release every block of ``table`` (tail first: a sequence's prefix is evicted last)
        and empty it."""
        self.pool.release(reversed(table))
        truncate_table(table, 0)

    # ------------------------------------------------------------------ prefix cache

    def match(self, table: list[int], hashes: Sequence[bytes], max_tokens: int) -> int:
        """Start the empty ``table`` with the longest run of cached blocks whose hashes are
        ``hashes``' first ones, at most ``max_tokens`` tokens' worth (whole blocks), taking a
        reference on each; returns the tokens they hold (0 without prefix caching). Undo with
        :meth:`free`; count an admitted lookup with :meth:`count_lookup`."""
        if not self.enable_prefix_caching:
            return 0
        assert not table, "match starts an empty table"
        found = []
        for h in hashes[: max_tokens // self.block_size]:
            b = self.pool.lookup(h)
            if b is None:
                break
            found.append(b)
        for b in found:
            self.pool.touch(b)
        table.extend(found)
        return len(found) * self.block_size

    def count_lookup(self, queried: int, hit: int) -> None:
        """An admitted request looked up ``queried`` tokens and found ``hit``."""
        if self.enable_prefix_caching:
            self.num_queries += queried
            self.num_hits += hit

    def cache_blocks(self, table: Sequence[int], hashes: Sequence[bytes], num_computed: int, start: int = 0) -> int:
        """The KV of ``table``'s first ``num_computed`` tokens is computed: make each full
        block among them from index ``start`` on findable by its hash (``hashes``: the
        sequence's full blocks' hashes so far). Returns the index to start from next time."""
        if not self.enable_prefix_caching:
            return start
        end = min(num_computed // self.block_size, len(hashes), len(table))
        for i in range(start, end):
            self.pool.cache(table[i], hashes[i])
        return max(start, end)
