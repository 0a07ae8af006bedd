"""CUDA graphs for the small steps: decode, verify and draft propose (docs/kernels.md).

A decode step of a small batch is launch-bound: hundreds of kernels of a few microseconds,
each paying Python and launch overhead. Captured once as a CUDA graph and replayed, the
step costs one launch. A graph freezes shapes and addresses, so:

- Graphs are captured for **shapes** ``(B, Q)``: ``B`` sequences (a batch-size bucket) of
  exactly ``Q`` query tokens each (1 for decode and propose, ``1 + k`` for verify).
- A step of ``S <= B`` sequences, each bringing ``n_i <= Q`` tokens, is **padded** to the
  smallest captured shape that holds it: a sequence's tokens beyond ``n_i`` and the
  ``B - S`` padding sequences write no KV (slot -1) and their outputs are dropped. Padding
  tokens sit after the real ones, so causal attention keeps them out of every real token's
  view; padding sequences have ``seq_len = Q`` over block 0 (any valid block would do).
- All graphs read **one set of static input buffers** (sized for the largest shape; a
  shape uses a prefix) and write one static hidden-state buffer; they share **one memory
  pool** (``torch.cuda.graph_pool_handle``), which the engine also shares between the
  target's and the draft's graphs. The LM head runs eagerly on the rows asked for only.
- Anything else runs **eagerly**: more sequences than the largest bucket, a sequence with
  more tokens than the longest captured query length (a prompt chunk), a CPU device,
  ``enforce_eager``, or ops without a capturable (Triton) implementation.

The bucket choice and the padding are plain functions (:func:`choose_shape`,
:func:`pad_batch`, :func:`plan_batch`); :class:`GraphRunner` with ``use_graphs=False`` runs
the very same padded buffers eagerly instead of replaying, which is how CPU tests check the
whole replay path against :meth:`ModelRunner.run` without a GPU.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from draftwise.kernels import AttentionBackend, AttentionMetadata, dispatch

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


def batch_size_buckets(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes up to ``max_num_seqs``, with ``max_num_seqs`` itself as the largest bucket
    (a step never has more sequences, so nothing above it is worth capturing)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return tuple(sorted({s for s in sizes if 1 <= s < max_num_seqs} | {max_num_seqs}))


def query_len_buckets(max_query_len: int) -> tuple[int, ...]:
    """Query lengths to capture for steps of at most ``max_query_len`` tokens per sequence
    (``1 + k`` for verify): every length up to 8, then 12, 16 and the maximum, so that a
    verify step of short drafts is not padded to the longest."""
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    return tuple(sorted({q for q in (*range(1, 9), 12, 16) if q < max_query_len} | {max_query_len}))


@dataclass(frozen=True)
class GraphConfig:
    """Which step shapes get a graph."""

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES  # batch-size buckets (sequences per step)
    query_lens: tuple[int, ...] = (1,)  # query tokens per sequence: 1 (decode, propose), 1 + k (verify)
    max_num_tokens: int | None = None  # shapes with B * Q above this are not captured; None: no cap
    max_model_len: int | None = None  # longest context a step may reach; None: the model's positions
    # (sizes the static block tables, and with them the decode kernel's grid of context splits)

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "query_lens"):
            vals = getattr(self, name)
            if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
                raise ValueError(f"{name} must be distinct positive integers in increasing order, got {vals}")
        for name in ("max_num_tokens", "max_model_len"):
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
        return cls(batch_size_buckets(max_num_seqs), query_len_buckets(max_query_len), max_num_tokens, max_model_len)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The ``(B, Q)`` shapes to capture, smallest padded size first (ties: shorter Q)."""
        cap = self.max_num_tokens
        keys = [(b, q) for b in self.batch_sizes for q in self.query_lens if cap is None or b * q <= cap]
        return sorted(keys, key=lambda k: (k[0] * k[1], k[1]))


def choose_shape(shapes: Sequence[tuple[int, int]], num_seqs: int, max_query_len: int) -> tuple[int, int] | None:
    """The captured shape with the fewest padded tokens that holds ``num_seqs`` sequences of
    up to ``max_query_len`` tokens (``shapes`` ordered as :attr:`GraphConfig.shapes`); None:
    no graph holds the step, it runs eagerly."""
    for b, q in shapes:
        if b >= num_seqs and q >= max_query_len:
            return b, q
    return None


@dataclass
class PaddedBatch:
    """A step laid out for the graph of shape ``(batch_size, query_len)``: sequence ``i``'s
    tokens at rows ``[i * Q, i * Q + n_i)``, padding after them."""

    batch_size: int  # B, the bucket
    query_len: int  # Q, tokens per sequence in the graph
    num_seqs: int  # S <= B real sequences
    input_ids: np.ndarray  # [B * Q] int64: 0 at padding
    positions: np.ndarray  # [B * Q] int64: 0 at padding
    slot_mapping: np.ndarray  # [B * Q] int64: -1 (do not write) at padding
    query_start_loc: np.ndarray  # [B + 1] int32: i * Q
    seq_lens: np.ndarray  # [B] int32: start_pos + Q (real), Q (padding sequences)
    block_tables: np.ndarray  # [B, max_blocks] int32: each table truncated to its context, then 0
    logit_rows: np.ndarray  # [N] int64: rows of the logits asked for, in order (padding never)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len


def pad_batch(
    chunks: Sequence[SequenceChunk], batch_size: int, query_len: int, block_size: int, max_blocks: int
) -> PaddedBatch:
    """Lay ``chunks`` (each of 1..``query_len`` tokens, block tables covering their tokens)
    out as a ``(batch_size, query_len)`` step. ``chunks`` may be empty: all padding (what
    the graphs are captured with)."""
    b, q, s = batch_size, query_len, len(chunks)
    if s > b:
        raise ValueError(f"{s} sequences do not fit a bucket of {b}")
    ids = np.zeros(b * q, dtype=np.int64)
    pos = np.zeros(b * q, dtype=np.int64)
    slots = np.full(b * q, -1, dtype=np.int64)
    seq_lens = np.full(b, q, dtype=np.int32)
    tables = np.zeros((b, max_blocks), dtype=np.int32)
    rows = np.zeros(0, dtype=np.int64)
    if s:  # vectorised over all tokens: this runs on the host every step
        ns = np.fromiter((len(c.token_ids) for c in chunks), np.int64, s)  # [S] tokens per sequence
        starts = np.fromiter((c.start_pos for c in chunks), np.int64, s)  # [S]
        wanted = np.fromiter((c.num_logits for c in chunks), np.int64, s)  # [S]
        bad = np.flatnonzero((ns < 1) | (ns > q))
        if bad.size:
            raise ValueError(f"sequence {bad[0]} brings {ns[bad[0]]} tokens; the shape holds 1 to {q}")
        need = -(-(starts + ns) // block_size)  # [S] blocks covering each sequence's tokens
        for i, c in enumerate(chunks):
            k = int(need[i])
            if len(c.block_table) < k or k > max_blocks:
                raise ValueError(
                    f"sequence {i}: block table of {len(c.block_table)} blocks for {starts[i] + ns[i]} tokens"
                )
            tables[i, :k] = c.block_table[:k]
        seq_of = np.repeat(np.arange(s), ns)  # [N] sequence of each real token
        j = np.arange(seq_of.size) - (np.cumsum(ns) - ns)[seq_of]  # [N] its index within its sequence
        dest = seq_of * q + j  # [N] its row in the padded layout
        p = starts[seq_of] + j  # [N] its position
        ids[dest] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, seq_of.size)
        pos[dest] = p
        slots[dest] = tables[seq_of, p // block_size].astype(np.int64) * block_size + p % block_size
        seq_lens[:s] = starts + q  # padding tokens after the real ones: causal attention hides them
        rows = dest[j >= (ns - wanted)[seq_of]]  # the last num_logits tokens of each sequence
    return PaddedBatch(
        batch_size=b,
        query_len=q,
        num_seqs=len(chunks),
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        query_start_loc=np.arange(b + 1, dtype=np.int32) * q,
        seq_lens=seq_lens,
        block_tables=tables,
        logit_rows=rows,
    )


def plan_batch(
    chunks: Sequence[SequenceChunk],
    shapes: Sequence[tuple[int, int]],
    block_size: int,
    max_blocks: int,
    max_positions: int,
) -> PaddedBatch | None:
    """The padded layout of a step, or None when it must run eagerly: no captured shape
    holds it (too many sequences, or a sequence with more tokens than any captured query
    length: a prompt chunk), or it is malformed (the eager path then raises the error)."""
    if not chunks:
        return None
    longest = 0
    for c in chunks:
        n = len(c.token_ids)
        if n < 1 or not 0 <= c.num_logits <= n or c.start_pos < 0 or c.start_pos + n > max_positions:
            return None
        if len(c.block_table) * block_size < c.start_pos + n:
            return None
        longest = max(longest, n)
    shape = choose_shape(shapes, len(chunks), longest)
    if shape is None:
        return None
    return pad_batch(chunks, shape[0], shape[1], block_size, max_blocks)


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


@dataclass
class _Buffers:
    """Static inputs of every graph, on the device, and their host staging copies."""

    i64: torch.Tensor  # [4, T_max] int64: input_ids, positions, slot_mapping, logit rows
    i32: torch.Tensor  # [n] int32: query_start_loc | seq_lens | block_tables, each 64-byte aligned
    host_i64: torch.Tensor  # pinned on CUDA
    host_i32: torch.Tensor
    qsl_at: int
    seq_lens_at: int
    tables_at: int
    max_seqs: int
    max_blocks: int
    views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def attention_views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query_start_loc [B + 1]``, ``seq_lens [B]``, ``block_tables [B, max_blocks]``."""
        v = self.views.get(b)
        if v is None:
            i32, mb = self.i32, self.max_blocks
            tables = i32[self.tables_at : self.tables_at + self.max_seqs * mb].view(self.max_seqs, mb)
            v = (i32[self.qsl_at : self.qsl_at + b + 1], i32[self.seq_lens_at : self.seq_lens_at + b], tables[:b])
            self.views[b] = v
        return v


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class GraphRunner:
    """CUDA graphs of one model over its KV cache, for the shapes of a :class:`GraphConfig`.

    ``run(chunks)`` pads a step into the static buffers and replays its graph, returning the
    logits asked for, or returns None when the step must run eagerly. With
    ``use_graphs=False`` (the default off CUDA) nothing is captured and ``run`` executes the
    model eagerly over the same static buffers: the CPU tests' stand-in for replay.
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
        max_q = max(q for _, q in self.shapes)
        # padded contexts run up to Q - 1 tokens past the last real one
        self.max_blocks = -(-(self.max_positions + max_q - 1) // self.block_size)
        max_b = max(b for b, _ in self.shapes)
        max_t = max(b * q for b, q in self.shapes)
        qsl_at, seq_lens_at = 0, _aligned(max_b + 1)
        tables_at = seq_lens_at + _aligned(max_b)
        pin = self.device.type == "cuda"
        host_i64 = torch.zeros(4, max_t, dtype=torch.int64, pin_memory=pin)
        host_i32 = torch.zeros(tables_at + max_b * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._buf = _Buffers(
            i64=torch.zeros_like(host_i64, device=self.device),
            i32=torch.zeros_like(host_i32, device=self.device),
            host_i64=host_i64,
            host_i32=host_i32,
            qsl_at=qsl_at,
            seq_lens_at=seq_lens_at,
            tables_at=tables_at,
            max_seqs=max_b,
            max_blocks=self.max_blocks,
        )
        self._np_i64 = host_i64.numpy()
        self._np_i32 = host_i32.numpy()
        dtype = model.embed_tokens.weight.dtype
        self._hidden = torch.zeros(max_t, model.config.hidden_size, dtype=dtype, device=self.device)  # [T_max, hidden]
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._metas: dict[tuple[int, int], AttentionMetadata] = {}
        self._copied: torch.cuda.Event | None = None
        self.pool = pool
        self.capture_seconds = 0.0
        self.capture_error: str | None = None
        self.num_replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ buffers

    def _load(self, batch: PaddedBatch) -> None:
        """Copy a padded step into the static buffers (one host-to-device copy per dtype)."""
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again
        t, b, n = batch.num_tokens, batch.batch_size, batch.logit_rows.shape[0]
        h64, h32, buf = self._np_i64, self._np_i32, self._buf
        h64[0, :t] = batch.input_ids
        h64[1, :t] = batch.positions
        h64[2, :t] = batch.slot_mapping
        h64[3, :n] = batch.logit_rows
        h32[buf.qsl_at : buf.qsl_at + b + 1] = batch.query_start_loc
        h32[buf.seq_lens_at : buf.seq_lens_at + b] = batch.seq_lens
        h32[buf.tables_at : buf.tables_at + b * self.max_blocks] = batch.block_tables.reshape(-1)
        end = buf.tables_at + b * self.max_blocks  # the block-table rows past the bucket are never read
        buf.i64.copy_(buf.host_i64, non_blocking=True)
        buf.i32[:end].copy_(buf.host_i32[:end], non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def _meta(self, b: int, q: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        qsl, seq_lens, tables = self._buf.attention_views(b)
        return AttentionMetadata(
            slot_mapping=self._buf.i64[2, : b * q],
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=self.block_size,
            query_lens_cpu=[q] * b,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=q,
            max_seq_len=max(seq_lens_cpu),
            has_padding=True,  # a padded shape: slots of padding tokens are -1
        )

    def _forward(self, b: int, q: int, meta: AttentionMetadata) -> None:
        """The model over the static inputs of shape ``(b, q)``; hidden states to the static output."""
        t = b * q
        hidden = self.model(self._buf.i64[0, :t], self._buf.i64[1, :t], self.kv_cache.layers, meta, self.backend)
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
            self._metas.clear()
            self.capture_error = f"{type(e).__name__}: {e}"
            log.warning("cuda graph capture failed; running eagerly", error=self.capture_error)
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        if self._graphs:
            log.info(
                "cuda graphs captured",
                graphs=len(self._graphs),
                batch_sizes=sorted({b for b, _ in self.shapes}),
                query_lens=sorted({q for _, q in self.shapes}),
                seconds=round(self.capture_seconds, 2),
            )
        return self.capture_seconds

    def _capture_all(self, stream: torch.cuda.Stream) -> None:
        """Warm up and capture each shape on ``stream`` (the documented pattern: an eager run
        on a side stream first, then ``torch.cuda.graph`` into the shared pool)."""
        for b, q in reversed(self.shapes):
            # host fields at their worst case: a kernel sizing its grid from them must cover
            # any step this graph will replay; the lengths themselves come from the buffers
            meta = self._meta(b, q, [self.max_blocks * self.block_size] * b)
            self._load(pad_batch([], b, q, self.block_size, self.max_blocks))
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(b, q, meta)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._forward(b, q, meta)
            self._graphs[(b, q)] = graph
            self._metas[(b, q)] = meta
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ replay

    @torch.inference_mode()
    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor | None:  # [sum num_logits, vocab] float32
        """Logits of a step run through its graph (or, without graphs, eagerly over the
        padded static buffers), in the order :meth:`ModelRunner.run` returns them; None when
        no captured shape holds the step."""
        if self.use_graphs and not self._graphs:
            return None
        batch = plan_batch(chunks, self.shapes, self.block_size, self.max_blocks, self.max_positions)
        if batch is None:
            return None
        b, q = batch.batch_size, batch.query_len
        if self.use_graphs:
            with torch.cuda.device(self.device):  # copies and replay on this device's current stream
                self._load(batch)
                self._graphs[(b, q)].replay()
        else:
            self._load(batch)
            self._forward(b, q, self._meta(b, q, batch.seq_lens.tolist()))
        self.num_replays += 1
        rows = self._buf.i64[3, : batch.logit_rows.shape[0]]  # [N]
        return self.model.compute_logits(self._hidden.index_select(0, rows))  # fresh tensor, outside the pool
