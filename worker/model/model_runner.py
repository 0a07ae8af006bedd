"""Runs one forward pass of a flat batch: the new tokens of many sequences (prompt chunks,
single decode tokens, verify runs) concatenated, each at its own position, attention
reading earlier context from the paged KV cache.

On CUDA, :meth:`ModelRunner.enable_graphs` captures the small steps (decode, verify,
draft propose) as CUDA graphs; ``run`` then replays them where a step fits a captured
shape and runs everything else eagerly (``draftwise.worker.model.graph_runner``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import structlog
import torch

from draftwise.kernels import AttentionMetadata, get_attention_backend
from draftwise.kernels.flat_batch import FlatBatch
from draftwise.kernels.launch_plan import num_sms, warm_up_plan
from draftwise.worker.model.block_tables import MIN_WIDTH, BlockTableRows
from draftwise.worker.model.chunk import SequenceChunk
from draftwise.worker.model.graph_runner import GraphRunner, graph_unsupported_reason
from draftwise.worker.model.graph_shapes import GraphConfig
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import LoadedModel

log = structlog.get_logger("draftwise.runner")

DECODE_STEP_TOKENS = 32
"""Steps of at most this many tokens (decode, verify) run on ``ModelRunner.decode_threads`` threads on
CPU: they stream the weights and gain little from more threads, while a gateway sharing the cores
stalls every thread of the team it preempts."""

RANK_EXIT_WAIT_S = 2.0
"""How long a failed tensor-parallel step waits for a dead rank's exit to be recorded, to name it
(its closed connection can fail the collective before its process is reaped)."""


class Peers(Protocol):
    """The other ranks of a tensor-parallel worker, as rank 0 sees them
    (``draftwise.worker.parallel.leader.Ranks``)."""

    def announce(self, message: tuple[Any, ...]) -> None: ...  # tell every other rank what to run next

    def failure(self, wait_s: float = 0.0) -> str | None: ...  # why a rank stopped, when one has


class ModelRunner:
    """A loaded model, its KV cache and its attention backend."""

    def __init__(
        self, loaded: LoadedModel, kv_cache: KVCache, prefer_reference: bool = False, peers: Peers | None = None
    ) -> None:
        self.peers = peers
        """Rank 0 of a tensor-parallel worker: the other ranks, told each forward pass to run it too."""
        self.loaded = loaded
        self.model = loaded.model
        self.kv_cache = kv_cache
        self.device = loaded.device
        self.backend = get_attention_backend(loaded.device, prefer_reference)
        self.graph_runner: GraphRunner | None = None  # set by enable_graphs on CUDA
        self.block_tables = BlockTableRows(self.device)
        """The block tables of the sequences this runner reads, kept on the device between steps."""
        self.decode_threads: int | None = None
        """CPU: torch threads for steps of at most DECODE_STEP_TOKENS tokens (None: as for any step)."""

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def enable_graphs(self, config: GraphConfig, pool: Any = None, enforce_eager: bool = False) -> GraphRunner | None:
        """Capture CUDA graphs for the shapes of ``config`` (sharing the memory pool ``pool``
        when given); steps that fit one are replayed from then on. Returns None, capturing
        nothing, where graphs do not apply (``enforce_eager``, not CUDA, or an op without a
        capturable kernel) or when capture failed (logged); the runner then stays eager."""
        reason = graph_unsupported_reason(self.device, self.backend, enforce_eager)
        if reason is not None:
            log.info("cuda graphs off", reason=reason)
            return None
        if self.peers is not None:  # every rank captures the same shapes: replays run their collectives together
            self.peers.announce(("graphs", config, enforce_eager))
        runner = GraphRunner(self.model, self.kv_cache, self.backend, config, pool=pool, block_rows=self.block_tables)
        runner.capture()
        if not runner.num_graphs:
            return None
        self.graph_runner = runner
        return runner

    @torch.inference_mode()
    def warm_up(self, max_num_seqs: int, max_num_tokens: int, max_context: int) -> int:
        """Launch every attention kernel variant eager steps of up to ``max_num_seqs``
        sequences, ``max_num_tokens`` tokens and contexts of ``max_context`` can launch
        (``draftwise.kernels.launch_plan.warm_up_plan``), so that a GPU compiles them now
        rather than while serving; the number of steps run (0 on the torch twin, which
        compiles nothing). The steps write KV into the cache's blocks: harmless, a block's
        slots are always written before they are read."""
        if self.backend.name == "torch":
            return 0
        cfg = self.model.config
        plan = warm_up_plan(
            max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_tokens,
            max_context=max_context,
            block_size=self.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            group=cfg.num_attention_heads // cfg.num_key_value_heads,
            num_sms=num_sms(self.device),
            min_width=MIN_WIDTH,
        )
        nb = self.kv_cache.num_blocks
        for seqs, n, width in plan:
            table = [i % nb for i in range(max(width, -(-n // self.block_size)))]
            self.forward_batch(self._flat([SequenceChunk([0] * n, 0, table)] * seqs), hidden=False)
        return len(plan)

    @torch.inference_mode()
    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:  # [sum num_logits, vocab] float32
        """Write the chunks' KV into the cache and return the logits asked for, in order. The
        step is laid out (and validated) once; a graph replays it where one holds it, the
        eager path runs it otherwise."""
        return self._forward(chunks, hidden=False)[0]

    @torch.inference_mode()
    def run_hidden(self, chunks: Sequence[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run`, also returning the final hidden states of every new token (the LM
        head's input, ``[sum of new tokens, hidden]`` in the chunks' order): what proposers
        that read the target's hidden states take, at no extra pass; a captured graph hands
        them over from its static buffer."""
        logits, hidden = self._forward(chunks, hidden=True)
        assert hidden is not None
        return logits, hidden

    def _forward(self, chunks: Sequence[SequenceChunk], hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step laid out (and validated) once; a graph replays it where one holds it (its
        hidden rows copied out only when asked), the eager path runs it otherwise."""
        if not chunks:
            raise ValueError("empty batch")
        return self.forward_batch(self._flat(chunks), hidden)

    def forward_batch(self, batch: FlatBatch, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a laid-out step: the logits asked for (and the hidden states when ``hidden``).
        Rank 0 of a tensor-parallel worker first tells the other ranks to run it with it; a
        failure after that leaves the ranks out of step, so it is raised as a step-wide error
        (a RuntimeError naming tensor parallelism: ``is_step_fatal``) that stops the engine
        rather than one request."""
        if self.peers is None:
            return self._forward_batch(batch, hidden)
        try:
            self.peers.announce(("run", batch, hidden))
            return self._forward_batch(batch, hidden)
        except Exception as e:
            why = self.peers.failure(wait_s=RANK_EXIT_WAIT_S) or repr(e)
            raise RuntimeError(f"tensor-parallel step failed: {why}") from e

    def _forward_batch(self, batch: FlatBatch, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.graph_runner is not None:
            logits = self.graph_runner.replay(batch)
            if logits is not None:
                return logits, self.graph_runner.hidden_rows(batch.num_tokens) if hidden else None
        return self._run_eager(batch)

    def _flat(self, chunks: Sequence[SequenceChunk]) -> FlatBatch:
        return FlatBatch.build(chunks, self.block_size, self.model.rope.max_positions)

    def _run_eager(self, batch: FlatBatch) -> tuple[torch.Tensor, torch.Tensor]:  # [L, vocab] float32, [N, hidden]
        """``batch`` uploaded as it is (one copy per dtype), over the persistent block-table
        rows: the logits asked for and the hidden states of every token; a small step on CPU on
        ``decode_threads`` threads (the thread count restored after it)."""
        few, full = self.decode_threads, torch.get_num_threads()
        if few is None or few >= full or self.device.type != "cpu" or batch.num_tokens > DECODE_STEP_TOKENS:
            return self._eager(batch)
        torch.set_num_threads(few)
        try:
            return self._eager(batch)
        finally:
            torch.set_num_threads(full)

    def _eager(self, batch: FlatBatch) -> tuple[torch.Tensor, torch.Tensor]:
        dev = batch.upload(self.device)
        tables = self.block_tables.gather(batch.block_tables)  # [S, W] int32
        meta = AttentionMetadata.for_batch(batch, dev, tables, self.block_size)
        hidden = self.model(dev.input_ids, dev.positions, self.kv_cache.layers, meta, self.backend)  # [N, hidden]
        selected = hidden if batch.logit_rows.shape[0] == batch.num_tokens else hidden[dev.logit_rows]
        return self.model.compute_logits(selected), hidden
