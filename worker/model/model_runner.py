"""Runs one forward pass of a flat batch: the new tokens of many sequences (prompt chunks,
single decode tokens, verify runs) concatenated, each at its own position, attention
reading earlier context from the paged KV cache.

On CUDA, :meth:`ModelRunner.enable_graphs` captures the small steps (decode, verify,
draft propose) as CUDA graphs; ``run`` then replays them where a step fits a captured
shape and runs everything else eagerly (``draftwise.worker.model.graph_runner``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

from draftwise.kernels import AttentionMetadata, get_attention_backend
from draftwise.worker.model.block_tables import MIN_WIDTH, BlockTableRows
from draftwise.worker.model.chunk import SequenceChunk
from draftwise.worker.model.graph_runner import GraphConfig, GraphRunner, graph_unsupported_reason
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import LoadedModel

log = structlog.get_logger("draftwise.runner")


class ModelRunner:
    """A loaded model, its KV cache and its attention backend."""

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, prefer_reference: bool = False) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv_cache = kv_cache
        self.device = loaded.device
        self.backend = get_attention_backend(loaded.device, prefer_reference)
        self.graph_runner: GraphRunner | None = None  # set by enable_graphs on CUDA
        self.block_tables = BlockTableRows(self.device)
        """The block tables of the sequences this runner reads, kept on the device between steps."""

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
        (``draftwise.kernels.triton_attention.warm_up_plan``), so that a GPU compiles them
        now rather than while serving; the number of steps run (0 on the torch twin, which
        compiles nothing). The steps write KV into the cache's blocks: harmless, a block's
        slots are always written before they are read."""
        if self.backend.name == "torch":
            return 0
        from draftwise.kernels import triton_attention as ta

        cfg = self.model.config
        plan = ta.warm_up_plan(
            max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_tokens,
            max_context=max_context,
            block_size=self.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            group=cfg.num_attention_heads // cfg.num_key_value_heads,
            num_sms=ta.num_sms(self.device),
            min_width=MIN_WIDTH,
        )
        nb = self.kv_cache.num_blocks
        for seqs, n, width in plan:
            table = [i % nb for i in range(max(width, -(-n // self.block_size)))]
            self._run_eager([SequenceChunk([0] * n, 0, table)] * seqs)
        return len(plan)

    @torch.inference_mode()
    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:  # [sum num_logits, vocab] float32
        """Write the chunks' KV into the cache and return the logits asked for, in order."""
        if self.graph_runner is not None:
            logits = self.graph_runner.run(chunks)
            if logits is not None:
                return logits
        return self._run_eager(chunks)

    def _run_eager(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:  # [sum num_logits, vocab] float32
        if not chunks:
            raise ValueError("empty batch")
        ids: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("a sequence chunk must bring at least one token")
            if not 0 <= c.num_logits <= n:
                raise ValueError(f"num_logits {c.num_logits} must be in [0, {n}]")
            if len(c.block_table) * self.block_size < c.start_pos + n:
                raise ValueError(f"block table of {len(c.block_table)} blocks cannot hold {c.start_pos + n} tokens")
            base = len(ids)
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.start_pos + n))
            logit_rows.extend(range(base + n - c.num_logits, base + n))
        max_pos = self.model.rope.max_positions
        if pos and max(pos) >= max_pos:
            raise ValueError(f"position {max(pos)} is beyond the model's context of {max_pos} tokens")
        meta = AttentionMetadata.build(
            query_lens=[len(c.token_ids) for c in chunks],
            seq_lens=[c.start_pos + len(c.token_ids) for c in chunks],
            block_tables=self.block_tables.gather([c.block_table for c in chunks]),
            block_size=self.block_size,
            device=self.device,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(pos, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta, self.backend)  # [T, hidden]
        if len(logit_rows) == len(ids):
            selected = hidden
        else:
            selected = hidden[torch.tensor(logit_rows, dtype=torch.int64, device=self.device)]
        return self.model.compute_logits(selected)
