"""The CPU default KV budget follows the model and max_num_seqs x max_model_len, within a cap."""

from __future__ import annotations

import os

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.engine.sizing import CPU_MAX_DEFAULT_KV_BYTES, cpu_default_kv_blocks
from draftwise.worker.model.kv_cache import bytes_per_block


def test_small_configuration_gets_a_small_cache():
    engine = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=4, block_size=16))
    assert engine.blocks.num_free_blocks == 4 * 256 // 16  # every sequence at full length, no more
    per_block = bytes_per_block(engine.loaded.config, 16, engine.loaded.dtype)
    assert engine.kv_cache.num_bytes == 64 * per_block < 16 << 20


def test_a_draft_shares_the_budget_and_gets_as_many_blocks():
    engine = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=2, speculative_model="default"))
    n = 2 * 128 // 16
    draft = engine.proposer
    assert draft is not None
    assert engine.blocks.num_free_blocks == n
    assert draft.blocks.num_blocks == draft.blocks.num_free_blocks == draft.kv_cache.num_blocks == n
    per_target = bytes_per_block(engine.loaded.config, 16, engine.loaded.dtype)
    per_draft = bytes_per_block(draft.loaded.config, 16, draft.loaded.dtype)
    assert engine.kv_cache.num_bytes == n * per_target and draft.kv_cache.num_bytes == n * per_draft
    # an explicit budget pays for both pools: as many blocks each, out of the one figure
    budget = 50 * (per_target + per_draft) + per_target  # a target block more, not a pair
    shared = LLMEngine(
        EngineConfig(max_model_len=128, max_num_seqs=2, speculative_model="default", kv_cache_memory_bytes=budget)
    )
    assert shared.proposer is not None
    assert shared.blocks.num_blocks == shared.proposer.blocks.num_blocks == shared.proposer.kv_cache.num_blocks == 50
    assert shared.kv_cache.num_bytes + shared.proposer.kv_cache.num_bytes <= budget


def test_the_default_is_capped_and_never_below_one_full_sequence():
    per_block = 160 * 1024  # 10 KiB a token, 16 tokens a block
    blocks = cpu_default_kv_blocks(per_block, 16, max_num_seqs=128, max_model_len=2048)  # needs 2.5 GiB
    cap = min(CPU_MAX_DEFAULT_KV_BYTES, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8)
    assert blocks * per_block <= CPU_MAX_DEFAULT_KV_BYTES and blocks == max(128, cap // per_block)
    assert cpu_default_kv_blocks(per_block, 16, max_num_seqs=2, max_model_len=100) == 2 * 7
    huge = cpu_default_kv_blocks(1 << 30, 16, max_num_seqs=8, max_model_len=64)  # one block over the cap
    assert huge == 4  # one sequence at full length all the same


def test_an_explicit_budget_or_block_count_wins():
    engine = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=4, num_kv_blocks=40))
    assert engine.blocks.num_free_blocks == 40
