"""The shapes CUDA graphs are captured for, and the padding of a step into one: plain code,
no device (CPU tests cover it; the graphs themselves are ``draftwise.worker.model.graph_runner``).

A graph freezes shapes and addresses, so graphs are captured for **shapes** ``(B, T, Q)``:
``B`` sequences (a batch-size bucket) bringing ``T`` query tokens in all (a token bucket), at
most ``Q`` each:

- **decode shapes** ``(B, B, 1)``: every sequence brings exactly one token (decode, a draft
  propose step). A step of ``S <= B`` sequences is padded with ``B - S`` sequences of one
  token each (slot -1: no KV written; ``seq_len`` 1 over whatever block their row holds);
  attention runs the flash-decoding kernel.
- **flat shapes** ``(B, T, Q)`` with ``Q = 1 + k`` the longest verify run: any mix of
  decode tokens, verify runs and draft catch-ups, laid out **flat** as the eager path lays
  them out (sequence ``i``'s ``n_i`` tokens right after sequence ``i - 1``'s), so that a step
  pads its *token count* ``N = sum n_i`` up to ``T``, never every sequence up to the step's
  longest run: 128 decodes and one verify of 1 + 5 tokens run as 133 tokens padded to the
  next bucket, not as 129 x 6. Padding tokens sit after all real ones, belong to no
  sequence and write no KV; padding sequences bring 0 tokens over a context of 0. The
  varlen attention kernel sizes its grid from ``Q`` (tiles past a sequence's tokens do
  nothing).

A step arrives laid out once (``draftwise.kernels.flat_batch.FlatBatch``, what the eager path
uploads as it is); :func:`plan_batch` chooses its shape (:func:`choose_shape`) and pads that
layout (:func:`pad_batch`), or sends it eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from draftwise.kernels.flat_batch import FlatBatch

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "GraphConfig",
    "PaddedBatch",
    "Shape",
    "batch_size_buckets",
    "choose_shape",
    "pad_batch",
    "plan_batch",
    "token_buckets",
]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

Shape = tuple[int, int, int]
"""``(B, T, Q)``: sequences, query tokens in all, most query tokens of one sequence (see the
module docstring; ``Q == 1`` is a decode shape, ``T == B``)."""


def batch_size_buckets(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes up to ``max_num_seqs``, with ``max_num_seqs`` itself as the largest bucket
    (a step never has more sequences, so nothing above it is worth capturing)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return tuple(sorted({s for s in sizes if 1 <= s < max_num_seqs} | {max_num_seqs}))


def token_buckets(low: int, high: int) -> tuple[int, ...]:
    """Token counts to capture for steps of ``low`` to ``high`` tokens: 2, 3, 4, 6, 8, 12,
    16, 24, ... (powers of two and one and a half times them, so a step pads at most a third
    of its tokens) from the first one at or above ``low``, with ``high`` itself as the largest."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {low}, {high}")
    sizes = {high}
    p = 1
    while p < high:
        sizes.update(s for s in (p, p + p // 2) if low <= s < high)
        p *= 2
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class GraphConfig:
    """Which step shapes get a graph."""

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES  # batch-size buckets (sequences per step)
    max_query_len: int = 1  # most query tokens of one sequence: 1 (decode, propose), 1 + k (verify)
    max_num_tokens: int | None = None  # shapes of more tokens than this are not captured; None: no cap
    max_model_len: int | None = None  # longest context a step may reach; None: the model's positions
    # (sizes the static block tables, and with them the decode kernel's grid of context splits)

    def __post_init__(self) -> None:
        vals = self.batch_sizes
        if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
            raise ValueError(f"batch_sizes must be distinct positive integers in increasing order, got {vals}")
        for name in ("max_query_len", "max_num_tokens", "max_model_len"):
            val = getattr(self, name)
            if val is not None and val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")

    @classmethod
    def for_steps(
        cls,
        max_num_seqs: int,
        max_query_len: int = 1,
        max_num_tokens: int | None = None,
        max_model_len: int | None = None,
    ) -> GraphConfig:
        """Buckets for a runner whose small steps have at most ``max_num_seqs`` sequences of
        at most ``max_query_len`` tokens each, within contexts of ``max_model_len``."""
        return cls(batch_size_buckets(max_num_seqs), max_query_len, max_num_tokens, max_model_len)

    @property
    def shapes(self) -> list[Shape]:
        """The shapes to capture, fewest tokens first (ties: fewer sequences, then decode).

        Decode shapes ``(B, B, 1)`` for every batch bucket; with ``max_query_len = Q > 1``,
        flat shapes ``(B, T, Q)`` for the token buckets a step of more than the previous
        bucket's sequences (and one token more than it has sequences) may need, up to
        ``B * Q`` or ``max_num_tokens``."""
        cap, q = self.max_num_tokens, self.max_query_len
        out: list[Shape] = [(b, b, 1) for b in self.batch_sizes if cap is None or b <= cap]
        if q > 1:
            prev = 0
            for b in self.batch_sizes:
                low, high = prev + 2, b * q if cap is None else min(b * q, cap)
                if low <= high:
                    out.extend((b, t, q) for t in token_buckets(low, high))
                prev = b
        return sorted(out, key=lambda s: (s[1], s[0], s[2]))


def choose_shape(shapes: Sequence[Shape], num_seqs: int, num_tokens: int, longest: int) -> Shape | None:
    """The captured shape with the fewest padded tokens that holds a step of ``num_seqs``
    sequences bringing ``num_tokens`` tokens, at most ``longest`` each (``shapes`` ordered as
    :attr:`GraphConfig.shapes`); a step of one token per sequence takes a decode shape. None:
    no graph holds the step, it runs eagerly."""
    decode = longest == 1
    for b, t, q in shapes:
        if (q == 1) == decode and b >= num_seqs and t >= num_tokens and q >= longest:
            return b, t, q
    return None


@dataclass
class PaddedBatch:
    """A step laid out for the graph of shape ``(batch_size, num_tokens, query_len)``: the
    real tokens flat at rows ``[0, N)`` in sequence order, padding after them."""

    batch_size: int  # B, the batch bucket
    num_tokens: int  # T, the token bucket
    query_len: int  # Q: 1 for a decode shape
    num_seqs: int  # S <= B real sequences
    num_real_tokens: int  # N <= T
    input_ids: np.ndarray  # [T] int64: 0 at padding
    positions: np.ndarray  # [T] int64: 0 at padding
    slot_mapping: np.ndarray  # [T] int64: -1 (do not write) at padding
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32: start_pos + n_i (real); 1 (decode padding) or 0 (flat padding)
    logit_rows: np.ndarray  # [L] int64: rows of the logits asked for, in order (padding never)

    @property
    def query_lens(self) -> list[int]:
        """Tokens of each of the ``B`` sequences (host ints)."""
        return np.diff(self.query_start_loc).tolist()


def pad_batch(batch: FlatBatch, shape: Shape) -> PaddedBatch:
    """Lay a built step out for ``shape``: its arrays at rows ``[0, N)``, padding after them.
    ``batch`` may be empty: all padding (what the graphs are captured with). Host work is
    proportional to the step's tokens (``batch`` read only its new tokens' blocks)."""
    b, t, q = shape
    s, n = batch.num_seqs, batch.num_tokens
    if s > b:
        raise ValueError(f"{s} sequences do not fit a bucket of {b}")
    if n > t:
        raise ValueError(f"{n} tokens do not fit a shape of {t}")
    if batch.max_query_len > q or (q == 1 and n != s):
        raise ValueError(f"a sequence brings {batch.max_query_len} tokens; the shape holds 1 to {q}")
    ids = np.zeros(t, dtype=np.int64)
    pos = np.zeros(t, dtype=np.int64)
    slots = np.full(t, -1, dtype=np.int64)
    ids[:n], pos[:n], slots[:n] = batch.input_ids, batch.positions, batch.slot_mapping
    seq_lens = np.zeros(b, dtype=np.int32)
    seq_lens[:s] = batch.seq_lens
    if q == 1:  # decode: padding sequences of one token each (over a context of 1), at rows S..B-1
        qsl = np.arange(b + 1, dtype=np.int32)
        seq_lens[s:] = 1
    else:  # flat: padding sequences of no tokens, all starting after the real tokens
        qsl = np.full(b + 1, n, dtype=np.int32)
        qsl[: s + 1] = batch.query_start_loc
    return PaddedBatch(
        batch_size=b,
        num_tokens=t,
        query_len=q,
        num_seqs=s,
        num_real_tokens=n,
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        logit_rows=batch.logit_rows,
    )


def plan_batch(batch: FlatBatch, shapes: Sequence[Shape], max_positions: int) -> PaddedBatch | None:
    """The padded layout of a built step, or None when it must run eagerly: no captured shape
    holds it (too many sequences or tokens, or a sequence with more tokens than any captured
    query length: a prompt chunk), or a context past ``max_positions`` (the static tables'
    reach)."""
    if not batch.num_seqs or batch.max_seq_len > max_positions:
        return None
    shape = choose_shape(shapes, batch.num_seqs, batch.num_tokens, batch.max_query_len)
    return None if shape is None else pad_batch(batch, shape)
