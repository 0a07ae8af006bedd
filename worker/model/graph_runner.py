"""CUDA graphs for the small steps: decode, verify and draft propose (docs/kernels.md).

A decode step of a small batch is launch-bound: hundreds of kernels of a few microseconds,
each paying Python and launch overhead. Captured once as a CUDA graph and replayed, the
step costs one launch. A graph freezes shapes and addresses, so graphs are captured for the
**shapes** ``(B, T, Q)`` of a :class:`~draftwise.worker.model.graph_shapes.GraphConfig`
(``B`` sequences bringing ``T`` tokens, at most ``Q`` each), and a step is padded into the
smallest that holds it (``draftwise.worker.model.graph_shapes``, which says how).

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

:class:`GraphRunner` with ``use_graphs=False`` runs the very same padded buffers eagerly
instead of replaying, which is how CPU tests check the whole replay path against
:meth:`ModelRunner.run` without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
import torch

from draftwise.kernels import AttentionBackend, AttentionMetadata, dispatch
from draftwise.kernels.flat_batch import FlatBatch
from draftwise.worker.model.block_tables import BlockTableRows
from draftwise.worker.model.graph_shapes import GraphConfig, PaddedBatch, Shape, pad_batch, plan_batch

if TYPE_CHECKING:
    from draftwise.worker.model.chunk import SequenceChunk
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.llama import LlamaModel

log = structlog.get_logger("draftwise.graphs")

# ops that must have a capturable implementation on the device before anything is captured
# (the torch twins plan attention on the host and filter negative slots with a host read)
CAPTURED_OPS = ("write_kv_cache", "paged_attention")
_ALIGN = 16  # elements: each static int32 section starts 64-byte aligned


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

    ``replay(batch)`` pads a step laid out by ``FlatBatch.build`` (what :meth:`ModelRunner.run`
    hands it) into the static buffers and replays its graph, returning the logits asked for,
    or returns None when the step must run eagerly; ``run(chunks)`` lays the chunks out first.
    With ``use_graphs=False`` (the default off CUDA) nothing is captured and ``replay``
    executes the model eagerly over the same static buffers: the CPU tests' stand-in for replay.
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
        self._hidden = torch.zeros(max_t, model.feature_width, dtype=dtype, device=self.device)  # [T_max, width]
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

    def _load(self, batch: PaddedBatch, tables: Sequence[Sequence[int]]) -> None:
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
        if tables:
            rows = self.block_rows.gather(tables)  # [S, W] on the device
            w = min(rows.shape[1], self.max_blocks)  # entries past max_blocks hold positions never attended
            self._tables[: len(tables), :w].copy_(rows[:, :w])
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
            batch = pad_batch(FlatBatch.build([], self.block_size), (b, t, q))
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

    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor | None:  # [sum num_logits, vocab] float32
        """:meth:`replay` of ``chunks`` laid out (and validated: malformed chunks raise) as
        :meth:`ModelRunner.run` lays them out."""
        return self.replay(FlatBatch.build(chunks, self.block_size, self.model.rope.max_positions))

    def hidden_rows(self, num_tokens: int) -> torch.Tensor:  # [N, hidden]
        """The final hidden states of the last replayed step's ``num_tokens`` real tokens (rows
        ``[0, N)`` of the static buffer: :class:`PaddedBatch` puts them there), copied out
        before the next replay overwrites them."""
        return self._hidden[:num_tokens].clone()

    @torch.inference_mode()
    def replay(self, batch: FlatBatch) -> torch.Tensor | None:  # [L, vocab] float32
        """Logits of a step run through its graph (or, without graphs, eagerly over the
        padded static buffers), in the order :meth:`ModelRunner.run` returns them; None when
        no captured shape holds the step."""
        if self.use_graphs and not self._graphs:
            return None
        padded = plan_batch(batch, self.shapes, self.max_positions)
        if padded is None:
            return None
        b, t, q = padded.batch_size, padded.num_tokens, padded.query_len
        if self.use_graphs:
            with torch.cuda.device(self.device):  # copies and replay on this device's current stream
                self._load(padded, batch.block_tables)
                self._graphs[(b, t, q)].replay()
        else:
            self._load(padded, batch.block_tables)
            self._forward(t, self._meta(b, t, q, padded.query_lens, padded.seq_lens.tolist()))
        self.num_replays += 1
        self.real_tokens += padded.num_real_tokens
        self.padded_tokens += t
        rows = self._i64[3, : padded.logit_rows.shape[0]]  # [L]
        return self.model.compute_logits(self._hidden.index_select(0, rows))  # fresh tensor, outside the pool
