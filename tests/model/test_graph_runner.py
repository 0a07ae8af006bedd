"""The graph runner's plain parts on CPU: shape choice, padding of every static buffer,
the eager fallbacks, and the whole replay path (static buffers, flat padding, block tables
from the persistent rows, dropped outputs) run eagerly against ModelRunner.run on the same
steps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from draftwise.kernels import get_attention_backend
from draftwise.kernels.flat_batch import FlatBatch
from draftwise.worker import default_model_path
from draftwise.worker.model.block_tables import BlockTable, truncate_table
from draftwise.worker.model.graph_runner import GraphRunner, graph_unsupported_reason
from draftwise.worker.model.graph_shapes import (
    GraphConfig,
    batch_size_buckets,
    choose_shape,
    pad_batch,
    plan_batch,
    token_buckets,
)
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk

# ---------------------------------------------------------------- shapes


def test_batch_size_buckets_cap_at_max_num_seqs():
    assert batch_size_buckets(128) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert batch_size_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert batch_size_buckets(3) == (1, 2, 3)
    assert batch_size_buckets(1) == (1,)
    assert batch_size_buckets(10, sizes=(4, 8, 16)) == (4, 8, 10)
    with pytest.raises(ValueError):
        batch_size_buckets(0)


def test_token_buckets():
    assert token_buckets(2, 6) == (2, 3, 4, 6)
    assert token_buckets(2, 5) == (2, 3, 4, 5)
    assert token_buckets(66, 768) == (96, 128, 192, 256, 384, 512, 768)
    assert token_buckets(130, 1000) == (192, 256, 384, 512, 768, 1000)
    assert token_buckets(7, 7) == (7,)
    for low, high in [(0, 4), (5, 4)]:
        with pytest.raises(ValueError):
            token_buckets(low, high)


def test_graph_config_shapes_order_and_cap():
    assert GraphConfig(batch_sizes=(1, 2, 4)).shapes == [(1, 1, 1), (2, 2, 1), (4, 4, 1)]  # decode only
    cfg = GraphConfig(batch_sizes=(1, 2, 4), max_query_len=3)
    # flat shapes: B = 1 holds 2..3 tokens, B = 2 holds 3..6 (it has more than 1 sequence), B = 4 holds 4..12
    flat = [(1, 2, 3), (1, 3, 3), (2, 3, 3), (2, 4, 3), (2, 6, 3), (4, 4, 3), (4, 6, 3), (4, 8, 3), (4, 12, 3)]
    assert sorted(s for s in cfg.shapes if s[2] == 3) == sorted(flat)
    assert cfg.shapes == sorted(cfg.shapes, key=lambda s: (s[1], s[0], s[2]))  # fewest tokens first
    capped = GraphConfig(batch_sizes=(1, 2, 4), max_query_len=3, max_num_tokens=6)
    assert max(t for _, t, _ in capped.shapes) == 6 and (4, 6, 3) in capped.shapes
    assert GraphConfig.for_steps(5, 3).batch_sizes == (1, 2, 4, 5)
    for bad in [dict(batch_sizes=()), dict(batch_sizes=(2, 1)), dict(max_query_len=0), dict(max_num_tokens=0)]:
        with pytest.raises(ValueError):
            GraphConfig(**bad)


def test_choose_shape_pads_the_token_count_not_every_sequence():
    shapes = GraphConfig(batch_sizes=(1, 2, 4, 8), max_query_len=4).shapes
    assert choose_shape(shapes, 1, 1, 1) == (1, 1, 1)
    assert choose_shape(shapes, 3, 3, 1) == (4, 4, 1)  # decode: a decode shape
    assert choose_shape(shapes, 8, 8, 1) == (8, 8, 1)
    assert choose_shape(shapes, 2, 2, 1) == (2, 2, 1)
    assert choose_shape(shapes, 5, 9, 4) == (8, 12, 4)  # four decodes and one verify of 5: 12 tokens, not 8 x 4
    assert choose_shape(shapes, 2, 3, 2) == (2, 3, 4)
    assert choose_shape(shapes, 9, 9, 1) is None  # above the largest bucket
    assert choose_shape(shapes, 1, 5, 5) is None  # longer than any captured query
    capped = GraphConfig(batch_sizes=(1, 2, 4, 8), max_query_len=4, max_num_tokens=16).shapes
    assert choose_shape(capped, 5, 17, 4) is None  # more tokens than any captured shape
    assert choose_shape(capped, 5, 16, 4) == (8, 16, 4)
    # the example: 128 decodes and one verify of 1 + 5 run as 134 tokens padded to 192, not 129 x 6
    big = GraphConfig.for_steps(256, 6, max_num_tokens=2048).shapes
    assert choose_shape(big, 129, 134, 6) == (192, 192, 6)


# ---------------------------------------------------------------- padding


def _flat(chunks: list[SequenceChunk], block_size: int, max_positions: int | None = None) -> FlatBatch:
    return FlatBatch.build(chunks, block_size, max_positions)


def test_flat_batch_layout():
    """The one builder both paths read: tokens flat in chunk order, each with its position and
    cache slot, where each sequence starts, its context, and the rows whose logits it wants."""
    bs = 4
    chunks = [
        SequenceChunk([11, 12, 13], 5, [7, 2, 9, 4], 3),  # verify: positions 5..7 in block 2 (offsets 1-3)
        SequenceChunk([21], 8, [3, 1, 5, 8], 1),  # decode at position 8: block 5
        SequenceChunk([31, 32], 0, [6], 0),  # a short chunk asking for no logits
        SequenceChunk([41, 42, 43], 3, [1, 9], 2),  # crosses a block boundary: 3 in block 1, 4-5 in block 9
    ]
    f = _flat(chunks, bs)
    assert (f.num_seqs, f.num_tokens, f.max_query_len, f.max_seq_len) == (4, 9, 3, 9)
    assert f.input_ids.tolist() == [11, 12, 13, 21, 31, 32, 41, 42, 43]
    assert f.positions.tolist() == [5, 6, 7, 8, 0, 1, 3, 4, 5]
    assert f.slot_mapping.tolist() == [9, 10, 11, 20, 24, 25, 7, 36, 37]
    assert f.query_start_loc.tolist() == [0, 3, 4, 6, 9] and f.query_lens == [3, 1, 2, 3]
    assert f.seq_lens.tolist() == [8, 9, 2, 6]
    assert f.logit_rows.tolist() == [0, 1, 2, 3, 7, 8]
    assert f.block_tables[0] is chunks[0].block_table  # the chunks' own tables, for the persistent rows
    assert f.input_ids.dtype == f.slot_mapping.dtype == f.logit_rows.dtype == np.int64
    assert f.seq_lens.dtype == f.query_start_loc.dtype == np.int32
    empty = _flat([], bs)
    assert (empty.num_seqs, empty.num_tokens, empty.query_start_loc.tolist()) == (0, 0, [0])


def test_flat_batch_validates_every_chunk():
    with pytest.raises(ValueError, match="at least one token"):
        _flat([SequenceChunk([], 0, [0])], 4)
    with pytest.raises(ValueError, match="num_logits 2 must be in"):
        _flat([SequenceChunk([1], 0, [0], num_logits=2)], 4)
    with pytest.raises(ValueError, match="negative"):
        _flat([SequenceChunk([1], -1, [0])], 4)
    with pytest.raises(ValueError, match="beyond the model's context of 32"):
        _flat([SequenceChunk([1], 32, list(range(9)))], 4, max_positions=32)
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold 5 tokens"):
        _flat([SequenceChunk([1], 4, [0])], 4)


def test_flat_batch_reads_only_the_new_tokens_blocks():
    """Host work follows the step's tokens: a long table is read at the new tokens' blocks only."""

    class Counting(list):
        reads = 0

        def __getitem__(self, i):  # noqa: ANN001
            out = super().__getitem__(i)
            Counting.reads += len(out) if isinstance(i, slice) else 1
            return out

    long = Counting(range(1001))  # a 16,000-token context
    f = _flat([SequenceChunk([1, 2], 15_999, long, 2), SequenceChunk([3], 15_000, long)], block_size=16)
    assert f.slot_mapping.tolist() == [15_999, 16_000, 15_000]
    assert Counting.reads == 3  # the two blocks the first chunk's tokens land in, one for the decode


def test_pad_batch_flat_layout():
    bs = 4
    chunks = [
        SequenceChunk([11, 12, 13], 5, [7, 2, 9, 4], 3),
        SequenceChunk([21], 8, [3, 1, 5, 8], 1),
        SequenceChunk([31, 32], 0, [6], 0),
    ]
    b = pad_batch(_flat(chunks, bs), (4, 8, 4))
    assert (b.batch_size, b.num_tokens, b.query_len, b.num_seqs, b.num_real_tokens) == (4, 8, 4, 3, 6)
    pad = -1
    assert b.input_ids.tolist() == [11, 12, 13, 21, 31, 32, 0, 0]
    assert b.positions.tolist() == [5, 6, 7, 8, 0, 1, 0, 0]
    assert b.slot_mapping.tolist() == [9, 10, 11, 20, 24, 25, pad, pad]
    # the padding sequence brings no tokens, after the real ones, over no context
    assert b.query_start_loc.tolist() == [0, 3, 4, 6, 6]
    assert b.query_lens == [3, 1, 2, 0]
    assert b.seq_lens.tolist() == [8, 9, 2, 0]
    assert b.logit_rows.tolist() == [0, 1, 2, 3]  # padding rows and the no-logits chunk are dropped
    assert b.input_ids.dtype == np.int64 and b.slot_mapping.dtype == np.int64
    assert b.seq_lens.dtype == np.int32 and b.query_start_loc.dtype == np.int32


def test_pad_batch_decode_layout():
    chunks = [SequenceChunk([5], 9, [0, 3, 7]), SequenceChunk([6], 0, [2])]
    b = pad_batch(_flat(chunks, 4), (4, 4, 1))
    assert b.input_ids.tolist() == [5, 6, 0, 0]
    assert b.slot_mapping.tolist() == [29, 8, -1, -1]
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 4]  # padding sequences: one token each
    assert b.seq_lens.tolist() == [10, 1, 1, 1]
    assert b.logit_rows.tolist() == [0, 1]


def test_pad_batch_all_padding_and_errors():
    empty = _flat([], 16)
    b = pad_batch(empty, (2, 2, 1))
    assert b.slot_mapping.tolist() == [-1, -1] and b.seq_lens.tolist() == [1, 1] and b.logit_rows.tolist() == []
    f = pad_batch(empty, (2, 6, 3))
    assert f.slot_mapping.tolist() == [-1] * 6 and f.seq_lens.tolist() == [0, 0] and f.query_lens == [0, 0]
    with pytest.raises(ValueError, match="bucket"):
        pad_batch(_flat([SequenceChunk([1], 0, [0])] * 3, 16), (2, 2, 1))
    with pytest.raises(ValueError, match="brings 2 tokens"):
        pad_batch(_flat([SequenceChunk([1, 2], 0, [0])], 16), (1, 2, 1))
    with pytest.raises(ValueError, match="do not fit"):
        pad_batch(_flat([SequenceChunk([1, 2], 0, [0]), SequenceChunk([1, 2], 0, [0])], 16), (2, 3, 2))


def test_plan_batch_sends_other_steps_eager():
    shapes = GraphConfig(batch_sizes=(1, 2, 4), max_query_len=2).shapes

    def plan(chunks: list[SequenceChunk]):  # noqa: ANN202
        return plan_batch(_flat(chunks, 4), shapes, max_positions=32)

    decode = [SequenceChunk([1], 3, [0]), SequenceChunk([2], 7, [1, 2])]
    planned = plan(decode)
    assert planned is not None and (planned.batch_size, planned.num_tokens, planned.query_len) == (2, 2, 1)
    mixed = plan([*decode, SequenceChunk([1, 2], 0, [3])])
    assert mixed is not None and (mixed.batch_size, mixed.num_tokens, mixed.query_len) == (4, 4, 2)
    assert plan([]) is None
    assert plan([*decode, SequenceChunk([1, 2, 3], 0, [3])]) is None  # a prompt chunk
    assert plan([SequenceChunk([1], i, [0, 1]) for i in range(5)]) is None  # above the largest bucket
    assert plan([SequenceChunk([1], 32, list(range(9)))]) is None  # past the static tables' reach


# ---------------------------------------------------------------- when graphs are (not) used


@pytest.fixture(scope="module")
def loaded():
    return load_model(default_model_path("draft"), dtype="float32")  # 1 layer, 8 heads over 4 KV heads


def test_cpu_and_enforce_eager_never_capture(loaded):
    cfg = loaded.config
    cache = KVCache(cfg, 8, 4, torch.float32, "cpu")
    runner = ModelRunner(loaded, cache)
    assert runner.enable_graphs(GraphConfig()) is None and runner.graph_runner is None
    assert "CUDA device" in graph_unsupported_reason(torch.device("cpu"), runner.backend)
    cuda_twin = get_attention_backend("cuda", prefer_reference=True)  # no CUDA needed to build one
    assert "enforce_eager" in graph_unsupported_reason(torch.device("cuda"), cuda_twin, enforce_eager=True)
    assert "not capturable" in graph_unsupported_reason(torch.device("cuda"), cuda_twin)
    gr = GraphRunner(loaded.model, cache, runner.backend, GraphConfig(batch_sizes=(1, 2)))
    assert not gr.use_graphs
    assert gr.capture() == 0.0 and gr.num_graphs == 0
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(loaded.model, cache, runner.backend, GraphConfig(), use_graphs=True)


def test_max_model_len_bounds_the_static_block_tables(loaded):
    cache = KVCache(loaded.config, 40, 4, torch.float32, "cpu")
    backend = get_attention_backend("cpu")
    full = GraphRunner(loaded.model, cache, backend, GraphConfig(batch_sizes=(1, 2), max_query_len=3))
    assert full.max_blocks == -(-loaded.config.max_position_embeddings // 4)
    gr = GraphRunner(loaded.model, cache, backend, GraphConfig(batch_sizes=(1, 2), max_query_len=3, max_model_len=64))
    assert gr.max_blocks == 16  # flat padding never runs a context past its real tokens
    table = list(range(17))  # a block more than the context needs (reserved ahead): not copied past the width
    assert gr.run([SequenceChunk([5, 6, 7], 61, table, 3)]) is not None  # ends at 64: fits
    assert gr.run([SequenceChunk([5], 64, table)]) is None  # past max_model_len: eager


# ---------------------------------------------------------------- the replay path against ModelRunner.run


# per step, per sequence: (new tokens, logits wanted)
STEPS = [
    [(1, 1)] * 5,  # decode of 5: bucket 8, three padding sequences
    [(3, 3), (1, 1), (4, 4), (2, 2), (1, 1)],  # verify with different k: 11 tokens flat in a shape of 12
    [(2, 1), (1, 1)],  # draft catch-up: two tokens, logits for the last
    [(1, 1)],  # batch of one
    [(2, 2), (1, 0), (1, 1)],  # a sequence asking for no logits
    [(1, 1), (4, 4), (1, 1), (1, 1), (1, 1)],  # mostly decodes and one long verify
    [(1, 1)] * 3,  # decode again after flat steps: the rows of shorter steps left behind
]


def test_replay_path_matches_model_runner(loaded):
    """The padded static-buffer path (eager standing in for the graph) gives the logits and
    the KV cache that ModelRunner.run gives for the same steps; padding writes nothing; block
    tables that grow, and shrink after a rejection, reach the static rows."""
    torch.manual_seed(0)
    rng = random.Random(0)
    cfg = loaded.config
    bs, num_blocks = 4, 64
    caches = [KVCache(cfg, num_blocks, bs, torch.float32, "cpu") for _ in range(2)]
    for c in caches:  # the same random contents in both: a stray write would show
        torch.manual_seed(1)
        c.k.normal_()
        c.v.normal_()
    eager = ModelRunner(loaded, caches[0])
    padded_prefill = ModelRunner(loaded, caches[1])
    graphs = GraphRunner(
        loaded.model,
        caches[1],
        padded_prefill.backend,
        GraphConfig(batch_sizes=(1, 2, 4, 8), max_query_len=4),
        block_rows=padded_prefill.block_tables,
    )
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # block tables out of order
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (3, 7, 9, 12, 4)]
    lens = [len(p) for p in prompts]
    tables = [BlockTable(pool.pop() for _ in range(-(-n // bs))) for n in lens]  # exactly what the prompts need
    prefill = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for r in (eager, padded_prefill):  # prompt chunks: eager on both sides
        r.run(prefill)
    for n_step, step in enumerate(STEPS):
        chunks = []
        for i, (n, logits) in enumerate(step):
            while len(tables[i]) * bs < lens[i] + n:  # the block manager's append
                tables[i].extend([pool.pop()])
            chunks.append(SequenceChunk([rng.randrange(cfg.vocab_size) for _ in range(n)], lens[i], tables[i], logits))
            lens[i] += n
        want = eager.run(chunks)
        before = graphs.num_replays
        got = graphs.run(chunks)
        assert got is not None and graphs.num_replays == before + 1
        assert got.shape == want.shape  # padding outputs dropped
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-5, rtol=1e-5)
        if n_step == 1:  # a rejection: sequence 2's last 3 verified tokens go back, with a block
            lens[2] -= 3
            pool.extend(tables[2][-(-lens[2] // bs) :])
            truncate_table(tables[2], -(-lens[2] // bs))
    assert graphs.real_tokens == sum(n for step in STEPS for n, _ in step)
    # decode steps pad sequences (8 + 1 + 4), flat steps pad tokens (12 + 3 + 4 + 8)
    assert graphs.padded_tokens == 8 + 12 + 3 + 1 + 4 + 8 + 4


def test_model_runner_uses_the_graph_runner_for_small_steps_only(loaded):
    cfg = loaded.config
    runner = ModelRunner(loaded, KVCache(cfg, 16, 4, torch.float32, "cpu"))
    gr = GraphRunner(
        loaded.model, runner.kv_cache, runner.backend, GraphConfig(batch_sizes=(1, 2)), block_rows=runner.block_tables
    )
    runner.graph_runner = gr  # what enable_graphs sets on CUDA
    runner.run([SequenceChunk([1, 2, 3, 4, 5], 0, [3, 4]), SequenceChunk([6, 7], 0, [5])])  # prompts: eager
    assert gr.num_replays == 0
    out = runner.run([SequenceChunk([8], 5, [3, 4]), SequenceChunk([9], 2, [5])])  # decode: graph path
    assert gr.num_replays == 1 and out.shape == (2, cfg.vocab_size)
    runner.run([SequenceChunk([8], 6, [3, 4]), SequenceChunk([9], 3, [5]), SequenceChunk([1], 0, [6])])  # 3 > 2
    assert gr.num_replays == 1
    with pytest.raises(ValueError, match="num_logits"):  # a malformed step still raises on the eager path
        runner.run([SequenceChunk([8], 7, [3, 4], num_logits=2)])


def test_run_hidden_through_the_graph_path_matches_eager(loaded):
    """Proposers that read hidden states (EAGLE, Medusa) get the real tokens' rows of the
    graph's static buffer: the same hidden states and logits the eager path computes."""
    cfg = loaded.config
    eager = ModelRunner(loaded, KVCache(cfg, 16, 4, torch.float32, "cpu"))
    graphed = ModelRunner(loaded, KVCache(cfg, 16, 4, torch.float32, "cpu"))
    gr = GraphRunner(
        loaded.model,
        graphed.kv_cache,
        graphed.backend,
        GraphConfig(batch_sizes=(1, 2), max_query_len=3),
        block_rows=graphed.block_tables,
    )
    graphed.graph_runner = gr
    prompts = [SequenceChunk([1, 2, 3, 4, 5], 0, [3, 4]), SequenceChunk([6, 7], 0, [5])]
    for r in (eager, graphed):
        r.run_hidden(prompts)
    step = [SequenceChunk([8, 9, 10], 5, [3, 4], num_logits=3), SequenceChunk([9], 2, [5])]  # a verify and a decode
    want_logits, want_hidden = eager.run_hidden(step)
    got_logits, got_hidden = graphed.run_hidden(step)
    assert gr.num_replays == 1
    assert got_hidden.shape == (4, cfg.hidden_size)
    torch.testing.assert_close(got_hidden, want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
