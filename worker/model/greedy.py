"""Greedy decoding of one prompt in-process, straight on the model runtime. The engine
(continuous batching, sampling) supersedes this for serving; this stays as the smallest
end-to-end use of the runtime and a reference for tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import LoadedModel
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk


def greedy_tokens(
    loaded: LoadedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    block_size: int = 16,
) -> Iterator[int]:
    """Yield greedy continuation tokens of ``prompt_ids``, stopping at ``stop_ids``."""
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > loaded.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the context of {loaded.config.max_position_embeddings}"
        )
    num_blocks = -(-total // block_size)
    runner = ModelRunner(loaded, KVCache(loaded.config, num_blocks, block_size, loaded.dtype, loaded.device))
    table = list(range(num_blocks))
    logits = runner.run([SequenceChunk(list(prompt_ids), 0, table)])
    pos = len(prompt_ids)
    for _ in range(max_new_tokens):
        tok = int(logits[-1].argmax())
        yield tok
        if tok in stop_ids:
            return
        logits = runner.run([SequenceChunk([tok], pos, table)])
        pos += 1
