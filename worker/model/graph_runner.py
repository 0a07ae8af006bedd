"""CUDA graphs for the small steps: decode, verify and draft propose (docs/kernels.md).

A decode step of a small batch is launch-bound: hundreds of kernels of a few microseconds,
each paying Python and launch overhead. Captured once as a CUDA graph and replayed, the
step costs one launch. A graph freezes shapes and addresses, so graphs are captured for
**shapes** ``(B, T, Q)``: ``B`` sequences (a batch-size bucket) bringing ``T`` query tokens
in all (a token bucket), at most ``Q`` each:

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

All graphs of a runner read **one set of static input buffers** (sized for the largest
shape; a shape uses a prefix) and write one static hidden-state buffer; they share **one
memory pool** (``torch.cuda.graph_pool_handle``), which the engine also shares between the
target's and the draft's graphs. The LM head runs eagerly on the rows asked for only.
**Block tables** come from the model runner's persistent device rows
(:class:`~draftwise.worker.model.block_tables.BlockTableRows`): a step copies only the
entries that changed on the host and then the rows it needs device to device into the
static table, so the host work of a step does not grow with context length.

Anything else runs **eagerly**: more sequences than the largest bucket, more tokens than the
largest token bucket, a sequence with more tokens than ``Q`` (a prompt chunk), a CPU
device, ``enforce_eager``, or ops without a capturable (Triton) implementation.

The shape choice and the padding are plain functions (:func:`choose_shape`,
:func:`pad_batch`, :func:`plan_batch`); :class:`GraphRunner` with ``use_graphs=False`` runs
the very same padded buffers eagerly instead of replaying, which is how CPU tests check the
whole replay path against :meth:`ModelRunner.run` without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from draftwise.kernels import AttentionBackend, AttentionMetadata, dispatch
from draftwise.worker.model.block_tables import BlockTableRows

if TYPE_CHECKING:
    from draftwise.worker.model.chunk import SequenceChunk
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.llama import LlamaModel

log = structlog.get_logger("draftwise.graphs")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# ops that must have a capturable implementation on the device before anything is captured
# (the torch twins plan attention on the host and filter negative slots with a host read)
CAPTURED_OPS = ("write_kv_cache", "paged_attention")
_ALIGN = 16  # elements: each static int32 section starts 64-byte aligned

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


def pad_batch(chunks: Sequence[SequenceChunk], shape: Shape, block_size: int) -> PaddedBatch:
    """Lay ``chunks`` (block tables covering their tokens) out for ``shape``. ``chunks`` may
    be empty: all padding (what the graphs are captured with). Host work is proportional to
    the step's tokens: of each block table only the entries of the new tokens are read."""
    b, t, q = shape
    s = len(chunks)
    if s > b:
        raise ValueError(f"{s} sequences do not fit a bucket of {b}")
    ns = np.fromiter((len(c.token_ids) for c in chunks), np.int64, s)  # [S] tokens per sequence
    n = int(ns.sum())
    if n > t:
        raise ValueError(f"{n} tokens do not fit a shape of {t}")
    bad = np.flatnonzero((ns < 1) | (ns > q))
    if bad.size:
        raise ValueError(f"sequence {bad[0]} brings {ns[bad[0]]} tokens; the shape holds 1 to {q}")
    ids = np.zeros(t, dtype=np.int64)
    pos = np.zeros(t, dtype=np.int64)
    slots = np.full(t, -1, dtype=np.int64)
    qsl = np.zeros(b + 1, dtype=np.int32)
    seq_lens = np.zeros(b, dtype=np.int32)
    rows = np.zeros(0, dtype=np.int64)
    if q == 1:  # decode: padding sequences of one token each, at rows S..B-1
        qsl[:] = np.arange(b + 1)
        seq_lens[s:] = 1
    else:  # flat: padding sequences of no tokens, all starting after the real tokens
        qsl[s + 1 :] = n
    if s:
        starts = np.fromiter((c.start_pos for c in chunks), np.int64, s)  # [S]
        wanted = np.fromiter((c.num_logits for c in chunks), np.int64, s)  # [S]
        ends = np.cumsum(ns)  # [S] one past each sequence's last row
        seq_of = np.repeat(np.arange(s), ns)  # [N] sequence of each real token
        j = np.arange(n) - (ends - ns)[seq_of]  # [N] its index within its sequence
        p = starts[seq_of] + j  # [N] its position
        slot_list: list[int] = []
        for i, c in enumerate(chunks):  # the blocks of the new tokens only: O(tokens), not O(context)
            start, end = int(starts[i]), int(starts[i] + ns[i])
            first, last = start // block_size, (end - 1) // block_size
            if len(c.block_table) <= last:
                raise ValueError(f"sequence {i}: block table of {len(c.block_table)} blocks for {end} tokens")
            blocks = c.block_table[first : last + 1]
            slot_list.extend(blocks[x // block_size - first] * block_size + x % block_size for x in range(start, end))
        ids[:n] = np.fromiter((x for c in chunks for x in c.token_ids), np.int64, n)
        pos[:n] = p
        slots[:n] = slot_list
        if q == 1:
            seq_lens[:s] = starts + 1
        else:
            qsl[1 : s + 1] = ends
            seq_lens[:s] = starts + ns
        rows = np.flatnonzero(j >= (ns - wanted)[seq_of])  # the last num_logits tokens of each sequence
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
        logit_rows=rows,
    )


def plan_batch(
    chunks: Sequence[SequenceChunk], shapes: Sequence[Shape], block_size: int, max_positions: int
) -> PaddedBatch | None:
    """The padded layout of a step, or None when it must run eagerly: no captured shape
    holds it (too many sequences or tokens, or a sequence with more tokens than any captured
    query length: a prompt chunk), or it is malformed (the eager path then raises the error)."""
    if not chunks:
        return None
    longest = total = 0
    for c in chunks:
        n = len(c.token_ids)
        if n < 1 or not 0 <= c.num_logits <= n or c.start_pos < 0 or c.start_pos + n > max_positions:
            return None
        if len(c.block_table) * block_size < c.start_pos + n:
            return None
        longest = max(longest, n)
        total += n
    shape = choose_shape(shapes, len(chunks), total, longest)
    if shape is None:
        return None
    return pad_batch(chunks, shape, block_size)


def graph_unsupported_reason(
    device: torch.device, backend: AttentionBackend, enforce_eager: bool = False
) -> str | None:
    """Why graphs are not captured for a model on ``device`` with ``backend``; None: they can be."""
    if enforce_eager:
        return "enforce_eager is set"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {device.type}"
    if backend.name == "torch":
        return "paged attention runs the torch twin here (host-planned, not capturable)"
    for op in CAPTURED_OPS:
        if dispatch.backend_name(op, device) == "torch":
            return f"{op} has no capturable implementation on {device}"
    return None


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class GraphRunner:
    """CUDA graphs of one model over its KV cache, for the shapes of a :class:`GraphConfig`.

    ``run(chunks)`` pads a step into the static buffers and replays its graph, returning the
    logits asked for, or returns None when the step must run eagerly. With
    ``use_graphs=False`` (the default off CUDA) nothing is captured and ``run`` executes the
    model eagerly over the same static buffers: the CPU tests' stand-in for replay.
    ``block_rows`` are the persistent device block tables the step's rows are read from (the
    model runner's; a private set when not given).
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        config: GraphConfig,
        *,
        use_graphs: bool | None = None,
        pool: Any = None,
        block_rows: BlockTableRows | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.config = config
        self.device = kv_cache.k.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {self.device}")
        self.shapes = config.shapes
        if not self.shapes:
            raise ValueError(f"no shape fits max_num_tokens={config.max_num_tokens}")
        self.block_size = kv_cache.block_size
        self.max_positions = min(model.rope.max_positions, config.max_model_len or model.rope.max_positions)
        # static block-table width, a multiple of 16 (the row stride Triton specialises on)
        self.max_blocks = _aligned(-(-self.max_positions // self.block_size))
        self.block_rows = block_rows if block_rows is not None else BlockTableRows(self.device)
        max_b = max(b for b, _, _ in self.shapes)
        max_t = max(t for _, t, _ in self.shapes)
        self._seq_lens_at = _aligned(max_b + 1)
        self._i32_host_end = self._seq_lens_at + max_b  # query_start_loc | seq_lens: copied from the host
        pin = self.device.type == "cuda"
        self._host_i64 = torch.zeros(4, max_t, dtype=torch.int64, pin_memory=pin)  # ids, positions, slots, logit rows
        self._host_i32 = torch.zeros(self._i32_host_end, dtype=torch.int32, pin_memory=pin)
        self._i64 = torch.zeros_like(self._host_i64, device=self.device)
        self._i32 = torch.zeros_like(self._host_i32, device=self.device)
        self._tables = torch.zeros(max_b, self.max_blocks, dtype=torch.int32, device=self.device)  # [B_max, max_blocks]
        self._np_i64 = self._host_i64.numpy()
        self._np_i32 = self._host_i32.numpy()
        dtype = model.embed_tokens.weight.dtype
        self._hidden = torch.zeros(max_t, model.config.hidden_size, dtype=dtype, device=self.device)  # [T_max, hidden]
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self._copied: torch.cuda.Event | None = None
        self.pool = pool
        self.capture_seconds = 0.0
        self.capture_error: str | None = None
        self.num_replays = 0
        self.real_tokens = 0
        """Real tokens of the steps run through the graphs so far."""
        self.padded_tokens = 0
        """Tokens those steps ran as (their shapes' ``T``): ``1 - real / padded`` is the padding waste."""

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ buffers

    def _load(self, batch: PaddedBatch, chunks: Sequence[SequenceChunk]) -> None:
        """Copy a padded step into the static buffers: one host-to-device copy per dtype for
        the per-token and per-sequence fields, the block-table rows device to device."""
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again
        t, b, n = batch.num_tokens, batch.batch_size, batch.logit_rows.shape[0]
        h64, h32 = self._np_i64, self._np_i32
        h64[0, :t] = batch.input_ids
        h64[1, :t] = batch.positions
        h64[2, :t] = batch.slot_mapping
        h64[3, :n] = batch.logit_rows
        h32[: b + 1] = batch.query_start_loc
        h32[self._seq_lens_at : self._seq_lens_at + b] = batch.seq_lens
        self._i64.copy_(self._host_i64, non_blocking=True)
        self._i32.copy_(self._host_i32, non_blocking=True)
        if chunks:
            rows = self.block_rows.gather([c.block_table for c in chunks])  # [S, W] on the device
            w = min(rows.shape[1], self.max_blocks)  # entries past max_blocks hold positions never attended
            self._tables[: len(chunks), :w].copy_(rows[:, :w])
            # columns past w of these rows may hold an earlier step's ids: past every context, never read
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def _meta(self, b: int, t: int, q: int, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._i64[2, :t],
            query_start_loc=self._i32[: b + 1],
            seq_lens=self._i32[self._seq_lens_at : self._seq_lens_at + b],
            block_tables=self._tables[:b],
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=q,  # sizes the attention grid: the shape's, not the step's
            max_seq_len=max(seq_lens, default=0),
            has_padding=True,  # slots of padding tokens are -1
        )

    def _forward(self, t: int, meta: AttentionMetadata) -> None:
        """The model over the static inputs of ``t`` tokens; hidden states to the static output."""
        hidden = self.model(self._i64[0, :t], self._i64[1, :t], self.kv_cache.layers, meta, self.backend)
        self._hidden[:t].copy_(hidden)  # [T, hidden]

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every shape, largest first (smaller graphs reuse the pool's memory); the
        seconds it took. A failed capture is logged, leaves no graph, and steps run eagerly."""
        if not self.use_graphs:
            return 0.0
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.device(self.device):
                self._capture_all(torch.cuda.Stream(self.device))
        except Exception as e:  # a kernel that is not capturable: serve eagerly rather than not at all
            self._graphs.clear()
            self.capture_error = f"{type(e).__name__}: {e}"
            log.warning("cuda graph capture failed; running eagerly", error=self.capture_error)
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        if self._graphs:
            log.info(
                "cuda graphs captured",
                graphs=len(self._graphs),
                batch_sizes=sorted({b for b, _, _ in self.shapes}),
                max_tokens=max(t for _, t, _ in self.shapes),
                max_query_len=self.config.max_query_len,
                seconds=round(self.capture_seconds, 2),
            )
        return self.capture_seconds

    def _capture_all(self, stream: torch.cuda.Stream) -> None:
        """Warm up and capture each shape on ``stream`` (the documented pattern: an eager run
        on a side stream first, then ``torch.cuda.graph`` into the shared pool)."""
        for b, t, q in sorted(self.shapes, key=lambda s: (s[1], s[0]), reverse=True):
            batch = pad_batch([], (b, t, q), self.block_size)
            # host fields at their worst case: a kernel sizing anything from them covers any
            # step this graph will replay; the lengths themselves come from the buffers
            meta = self._meta(b, t, q, batch.query_lens, [self.max_positions] * b)
            self._load(batch, ())
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(t, meta)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._forward(t, meta)
            self._graphs[(b, t, q)] = graph
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ replay

    @torch.inference_mode()
    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor | None:  # [sum num_logits, vocab] float32
        """Logits of a step run through its graph (or, without graphs, eagerly over the
        padded static buffers), in the order :meth:`ModelRunner.run` returns them; None when
        no captured shape holds the step."""
        if self.use_graphs and not self._graphs:
            return None
        batch = plan_batch(chunks, self.shapes, self.block_size, self.max_positions)
        if batch is None:
            return None
        b, t, q = batch.batch_size, batch.num_tokens, batch.query_len
        if self.use_graphs:
            with torch.cuda.device(self.device):  # copies and replay on this device's current stream
                self._load(batch, chunks)
                self._graphs[(b, t, q)].replay()
        else:
            self._load(batch, chunks)
            self._forward(t, self._meta(b, t, q, batch.query_lens, batch.seq_lens.tolist()))
        self.num_replays += 1
        self.real_tokens += batch.num_real_tokens
        self.padded_tokens += t
        rows = self._i64[3, : batch.logit_rows.shape[0]]  # [L]
        return self.model.compute_logits(self._hidden.index_select(0, rows))  # fresh tensor, outside the pool
