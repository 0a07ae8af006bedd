"""What an engine sizes and prepares at start, before it serves: the KV cache's block count
(from the memory profile on CUDA, a share of the machine's memory on CPU), the kernel
warm-up, and CUDA graph capture. Plain functions of the engine's parts, called once by
``LLMEngine.__init__``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.memory_profile import MemoryProfile, cuda_peak_bytes, plan_probes, profile_activations
from draftwise.worker.model.graph_shapes import GraphConfig
from draftwise.worker.model.kv_cache import bytes_per_block
from draftwise.worker.model.loader import LoadedModel
from draftwise.worker.model.model_config import ModelConfig
from draftwise.worker.model.model_runner import ModelRunner
from draftwise.worker.speculative.cross_draft import CROSS_POOL_SCALE
from draftwise.worker.speculative.decoder import MAX_INLINE_BACKLOG
from draftwise.worker.speculative.heads import LoadedHead
from draftwise.worker.speculative.loading import head_kv_bytes_per_block
from draftwise.worker.speculative.vocab_bridge import VocabBridge

__all__ = [
    "CPU_MAX_DEFAULT_KV_BYTES",
    "CPU_MAX_DEFAULT_KV_SHARE",
    "capture_graphs",
    "check_capacity",
    "cpu_default_kv_blocks",
    "model_len",
    "num_kv_blocks",
    "warm_up_kernels",
]

log = structlog.get_logger("draftwise.engine")

CPU_MAX_DEFAULT_KV_BYTES = 1 << 30
"""The CPU default KV budget: enough for max_num_seqs sequences at max_model_len tokens, but
at most this and at most CPU_MAX_DEFAULT_KV_SHARE of the machine's memory."""
CPU_MAX_DEFAULT_KV_SHARE = 1 / 8


DEFAULT_CHUNKED_BATCH_TOKENS = 2048
"""max_num_batched_tokens with chunked prefill when the config leaves it unset."""


def model_len(config: EngineConfig, model: ModelConfig) -> int:
    """max_model_len: the config's, else the model's context; ValueError past the model's context."""
    n = config.max_model_len or model.max_position_embeddings
    if n > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len={n} exceeds the model's max_position_embeddings={model.max_position_embeddings}"
        )
    return n


def check_capacity(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """The KV cache's tokens; ValueError when one request of max_model_len would not fit."""
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer than "
            f"max_model_len={max_model_len}: raise the KV budget or lower max_model_len"
        )
    return capacity


def batch_token_budget(config: EngineConfig, max_model_len: int) -> int:
    """max_num_batched_tokens: the config's, or the default (2048 with chunked prefill, else
    max_model_len); ValueError when it cannot serve every request."""
    budget = config.max_num_batched_tokens or (
        DEFAULT_CHUNKED_BATCH_TOKENS if config.enable_chunked_prefill else max_model_len
    )
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({budget}) must be >= max_model_len "
            f"({max_model_len}) so that every prompt fits in one step"
        )
    if budget < config.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({config.max_num_seqs}): "
            "every running request needs at least one token per step"
        )
    return budget


def num_kv_blocks(
    config: EngineConfig,
    target: LoadedModel,
    drafter: LoadedModel | LoadedHead | None,
    max_batched: int,
    max_model_len: int,
    bridge: VocabBridge | None = None,
) -> tuple[int, MemoryProfile | None]:
    """Blocks for the target's KV pool (with a draft model or an EAGLE head, its own pool
    gets as many blocks of its size, CROSS_POOL_SCALE times as many for a draft with another
    tokenizer, read through ``bridge``, and all come out of the one budget), and the memory
    profile that sized them (None unless it was measured: CUDA without an explicit budget)."""
    per_block = bytes_per_block(target.kv_config, config.block_size, target.dtype)
    draft = drafter if isinstance(drafter, LoadedModel) else None
    if draft is not None:
        scale = 1 if bridge is None else CROSS_POOL_SCALE
        per_block += scale * bytes_per_block(draft.config, config.block_size, draft.dtype)
    per_block += head_kv_bytes_per_block(
        drafter if isinstance(drafter, LoadedHead) else None, target, config.block_size
    )
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, None
    prof = None
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif target.device.type == "cuda":
        budget, prof = cuda_kv_budget(config, target, draft, max_batched, max_model_len)
    else:
        n = config.tensor_parallel_size
        return cpu_default_kv_blocks(per_block, config.block_size, config.max_num_seqs, max_model_len, n), None
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV budget of {budget} bytes is smaller than one block ({per_block} bytes)")
    return int(blocks), prof


def cuda_kv_budget(
    config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, max_batched: int, max_model_len: int
) -> tuple[int, MemoryProfile]:
    """gpu_memory_utilization of the device, less the weights and the largest step's
    activation peak, probed before the cache exists (worker/engine/memory_profile.py)."""
    dev = target.device
    probes = plan_probes(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        spec_k=config.max_draft_tokens,
        draft_model=draft is not None,
    )
    prof = profile_activations(
        target, draft, probes, config.block_size, cuda_peak_bytes(dev), graphs=not config.enforce_eager
    )
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    budget = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(dev) - prof.activations
    log.info(
        "cuda memory profile",
        total_mib=total >> 20,
        activations_mib=prof.activations >> 20,
        peaks_mib={k: v >> 20 for k, v in prof.peaks.items()},
        graph_pool_mib=prof.graph_pool >> 20,
        kv_budget_mib=budget >> 20,
    )
    return budget, prof


def cpu_default_kv_blocks(
    per_block: int, block_size: int, max_num_seqs: int, max_model_len: int, ranks: int = 1
) -> int:
    """KV blocks on CPU when no budget is given: every one of ``max_num_seqs`` sequences at
    ``max_model_len`` tokens, within CPU_MAX_DEFAULT_KV_BYTES and CPU_MAX_DEFAULT_KV_SHARE of the
    machine's memory (shared by the ``ranks`` tensor-parallel ranks of a worker, which all live
    in it), and never less than one sequence at full length."""
    per_seq = -(-max_model_len // block_size)
    cap = CPU_MAX_DEFAULT_KV_BYTES // ranks
    with contextlib.suppress(ValueError, OSError):  # without sysconf: the fixed cap alone
        cap = min(
            cap, int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_MAX_DEFAULT_KV_SHARE) // ranks
        )
    return max(per_seq, min(max_num_seqs * per_seq, cap // per_block))


def warm_up_kernels(runners: Sequence[ModelRunner], max_num_seqs: int, max_batched: int, max_context: int) -> float:
    """With Triton kernels: launch every attention variant an eager step can need, for each
    runner (the target's, the draft's), so that nothing compiles while serving (graph capture
    compiles the graphs' own). Returns the seconds it took (0.0: the torch twins, nothing to do)."""
    t0 = time.perf_counter()
    steps = sum(r.warm_up(max_num_seqs, max_batched, max_context) for r in runners)
    if not steps:
        return 0.0
    seconds = time.perf_counter() - t0
    log.info("kernels warmed up", steps=steps, seconds=round(seconds, 2))
    return seconds


def capture_graphs(
    target: ModelRunner,
    draft: ModelRunner | None,
    config: EngineConfig,
    max_batched: int,
    max_model_len: int,
    spec_k: int,
) -> float:
    """On CUDA without ``enforce_eager``: CUDA graphs of the target's decode and verify
    steps (1 + ``spec_k`` tokens per request, laid out flat) and of the draft's propose steps
    (its unread tokens, at most MAX_INLINE_BACKLOG, then 1), for batch-size buckets up to
    max_num_seqs, all in one memory pool (docs/kernels.md). Returns the seconds capture took
    (0.0: none)."""
    if target.device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    n = config.max_num_seqs
    tg = target.enable_graphs(
        GraphConfig.for_steps(n, 1 + spec_k, max_batched, max_model_len), pool, config.enforce_eager
    )
    dg = None
    if draft is not None:
        dg = draft.enable_graphs(
            GraphConfig.for_steps(n, MAX_INLINE_BACKLOG, max_batched, max_model_len), pool, config.enforce_eager
        )
    seconds = time.perf_counter() - t0
    log.info(
        "cuda graph capture",
        seconds=round(seconds, 2),
        target_graphs=tg.num_graphs if tg else 0,
        draft_graphs=dg.num_graphs if dg else 0,
        enforce_eager=config.enforce_eager,
    )
    return seconds if tg or dg else 0.0


class Phases:
    """Seconds of each start-up phase: ``done(name)`` closes the phase running since the last call."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self._t, 3)
        self._t = now


def log_ready(engine: Any, num_blocks: int, capacity: int, max_batched: int) -> None:
    """The engine's (an ``LLMEngine``'s) "kv cache ready" line: what it was sized to, and its start-up phases."""
    log.info(
        "kv cache ready",
        blocks=num_blocks,
        block_size=engine.config.block_size,
        capacity_tokens=capacity,
        kv_mib=round(engine.kv_cache.num_bytes / 2**20, 1),
        weights_mib=round(engine.loaded.weight_bytes / 2**20, 1),
        max_model_len=engine.max_model_len,
        max_num_batched_tokens=max_batched,
        attention_backend=engine.runner.backend.name,
        speculation=engine.spec_method,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        quantization=engine.config.quantization,
        **engine.startup_phases,
    )
