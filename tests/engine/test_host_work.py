"""Per-step host work of decode does not grow with context length.

The model runner keeps every sequence's block table on the device between steps and copies in
only the entries that changed (``worker/model/block_tables.py``); rebuilding the tables from
Python lists every step, as the engine did before, costs O(context) per sequence per step.

The same batch of 4 requests decodes 16 steps at a short context (~40 tokens) and at a long one
(~1500 tokens, the same modulo the block size) on the real default model. Over any 16 consecutive decode steps each sequence
crosses exactly one block boundary (block size 16), so the host work must be the same at both
lengths:
- the block ids copied from host lists into the device rows: exactly one per sequence (the new
  block), at both lengths (the old rebuild copied every table in full: ~100 ids per sequence
  per step at the long context);
- the Python function calls, and calls into C, made by ``engine.step()``: the same count at
  both lengths (no Python loop over the context).
(tracemalloc's peak was tried as a third measure and dropped: it moves by a few KB from run to
run whatever the context.)
Counts, not timings: the result does not depend on the machine's speed. The test runs twice: on
the eager path, and with a graph runner standing in for CUDA graphs (its padded static buffers
take their block-table rows from the same persistent rows, device to device).
"""

from __future__ import annotations

import gc
import sys
from collections import Counter

import pytest

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model.block_tables import BlockTable, BlockTableRows, truncate_table
from draftwise.worker.model.graph_runner import GraphRunner
from draftwise.worker.model.graph_shapes import GraphConfig
from draftwise.worker.sampling.sampling_params import SamplingParams

NUM_SEQS = 4
BLOCK_SIZE = 16
STEPS = 16
SHORT, LONG = 40, 40 + 91 * BLOCK_SIZE
"""Prompt lengths (the same modulo the block size, so that block boundaries fall on the same
steps at both lengths)."""


@pytest.fixture(scope="module", params=["eager", "graph runner"])
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    """The engine as it runs on CPU, and with a graph runner over the same persistent rows
    standing in for CUDA graphs (the same padded static-buffer path, run eagerly)."""
    eng = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_model_len=2048,
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_SEQS * 2048 // BLOCK_SIZE,
            max_num_batched_tokens=NUM_SEQS * 2048,  # every prompt prefilled in one step
            skip_tokenizer_init=True,
        )
    )
    if request.param == "graph runner":
        r = eng.runner
        r.graph_runner = GraphRunner(
            r.model,
            r.kv_cache,
            r.backend,
            GraphConfig.for_steps(NUM_SEQS, 1, max_model_len=2048),
            use_graphs=False,
            block_rows=r.block_tables,
        )
    return eng


def _decode_work(engine: LLMEngine, prompt_len: int) -> dict[str, object]:
    """Prefill NUM_SEQS prompts of ``prompt_len`` tokens, decode to a block boundary, then
    measure STEPS decode steps."""
    vocab = engine.loaded.config.vocab_size
    for i in range(NUM_SEQS):
        prompt = [1] + [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len - 1 + i)]
        engine.add_request(f"{prompt_len}-{i}", prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(2):  # warm: the rows' width fits the longest table
        engine.step()
    rows: BlockTableRows = engine.runner.block_tables
    written0 = rows.entries_written
    graphs = engine.runner.graph_runner
    replays0 = graphs.num_replays if graphs is not None else 0
    calls: Counter[str] = Counter()

    def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
        calls[event] += 1

    gc.collect()  # no collection inside the measured steps: the finalizers it runs would be counted as
    gc.disable()  # the engine's calls, at times that depend on allocations elsewhere in the process
    sys.setprofile(profile)
    try:
        for _ in range(STEPS):
            out = engine.step()
            assert out.stats.num_scheduled == NUM_SEQS and out.stats.num_batched_tokens == NUM_SEQS  # decode only
    finally:
        sys.setprofile(None)
        gc.enable()
    contexts = [r.num_tokens for r in engine.scheduler.running]
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    if graphs is not None:
        assert graphs.num_replays - replays0 == STEPS  # every measured step went through the graph path
    return {
        "written": rows.entries_written - written0,
        "calls": calls["call"],
        "c_calls": calls["c_call"],
        "contexts": contexts,
    }


def test_decode_host_work_does_not_grow_with_context(engine: LLMEngine) -> None:
    _decode_work(engine, SHORT)  # first-time allocations (caches, the rows' growth) out of the way
    short = _decode_work(engine, SHORT)
    long = _decode_work(engine, LONG)
    print(f"\nshort {short}\nlong  {long}")
    assert max(short["contexts"]) < 100 and min(long["contexts"]) > 1400
    # one new block per sequence over 16 decode steps, at either length
    assert short["written"] == long["written"] == NUM_SEQS
    assert long["calls"] == short["calls"]
    assert long["c_calls"] == short["c_calls"]


def test_rows_follow_tail_changes() -> None:
    """The device rows match the tables, padded with 0, after every kind of change the block
    manager makes (grow, shrink, clear, regrow with other blocks), with only changed entries
    copied."""
    rows = BlockTableRows("cpu", rows=2, width=2)
    a, b = BlockTable([5, 6, 7]), BlockTable([1])
    assert rows.gather([a, b])[:, :3].tolist() == [[5, 6, 7], [1, 0, 0]]
    assert rows.entries_written == 4
    a.extend([8])
    assert rows.gather([a])[0, :4].tolist() == [5, 6, 7, 8] and rows.entries_written == 5
    truncate_table(a, 2)
    a.extend([9, 10])  # same length as before, other blocks at the tail
    assert rows.gather([b, a])[1, :4].tolist() == [5, 6, 9, 10] and rows.entries_written == 7
    truncate_table(a, 0)
    a.extend([3])
    assert rows.gather([a]).tolist() == [[3] + [0] * 15] and rows.entries_written == 8  # width: at least 16
    assert rows.table[a.copies[rows][0], :4].tolist() == [3, 0, 0, 0]  # the old tail zeroed in the row
    c, d = BlockTable(range(40)), [2, 4]  # more rows and columns than at the start; a plain list
    got = rows.gather([a, b, c, d])
    assert got.shape == (4, 64) and got[2, :40].tolist() == list(range(40)) and got[3, :2].tolist() == [2, 4]
    assert rows.gather([d])[0, :2].tolist() == [2, 4]  # a plain list is written in full each time
    assert rows.entries_written == 8 + 40 + 2 + 2
    free = len(rows._free)
    del c
    gc.collect()
    assert len(rows._free) == free + 1  # a dead table's row is free again


def test_penalty_counts_add_only_new_tokens(engine: LLMEngine) -> None:
    """A penalised request's counts live on the device (worker/sampling/token_counts.py): the
    host adds each token once, so decoding at a ~1500-token context adds what it generates,
    not the context again every step."""
    vocab = engine.loaded.config.vocab_size
    prompt = [1] + [(11 * j) % (vocab - 3) + 3 for j in range(LONG)]
    params = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.2, max_tokens=24, ignore_eos=True)
    engine.add_request("pen", prompt, params)
    req = engine.requests["pen"]
    while not req.output_token_ids:
        engine.step()
    counts = req.token_counts
    assert counts is not None
    added0, out0 = counts.tokens_added, len(req.output_token_ids)
    assert added0 == len(prompt) + out0 - 1  # the prompt once; the token just sampled is counted next step
    while engine.has_unfinished_requests():
        engine.step()
    assert len(req.output_token_ids) == 24
    assert counts.tokens_added - added0 <= 24 - out0 + 1  # the new tokens only
