"""The CPU kernel library's paged attention, KV write and fused decoder layer
(worker/model/cpu_attention.py, cpu_layer.py and their C++), against the torch twins and the module path:

- attention equals the twin within float32 rounding for grouped-query shapes, block sizes, sliding windows
  and batches mixing decode, verify and long prompt chunks (those left to torch, bit for bit); a row's
  result does not depend on the batch it is in;
- the KV write copies rows bit for bit, skips padding slots, and refuses a slot beyond the cache without
  writing anything;
- both fall back to the twins where they do not apply;
- the fused layer gives the module path's logits (float32 rounding: its silu), the feature layers' streams
  too, follows a change of the weights' packing, and steps aside where it does not apply.
"""

from __future__ import annotations

import pytest
import torch

from draftwise.kernels import AttentionMetadata, get_attention_backend, reference
from draftwise.worker import default_model_path
from draftwise.worker.model import cpu_attention, cpu_layer, cpu_matmul
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk

pytestmark = pytest.mark.skipif(cpu_matmul.kernel() is None, reason="unreachable: the kernel builds here")


@pytest.fixture(autouse=True)
def _kernel_builds():
    assert cpu_matmul.kernel() is not None, cpu_matmul.unavailable_reason()  # never skip silently on this machine


def _batch(query_lens, seq_lens, block_size, heads, kv_heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    blocks = sum(need) + 3
    order = torch.randperm(blocks, generator=g).tolist()  # each sequence's blocks scattered over the cache
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=block_size)
    kc = torch.randn(blocks, block_size, kv_heads, d, generator=g)
    vc = torch.randn(blocks, block_size, kv_heads, d, generator=g)
    t = sum(query_lens)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 2  # q a view with the whole row's stride
    return meta, qkv[:, : heads * d].view(t, heads, d), kc, vc


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 4, 32), (4, 4, 16), (16, 1, 8), (6, 2, 72)])
@pytest.mark.parametrize("block_size", [16, 1, 5])
@pytest.mark.parametrize("window", [None, 7, 100, 300])
def test_attention_matches_the_twin(heads, kv_heads, d, block_size, window):
    query_lens = [1, 4, 1, 33, 8, 1, 2]
    seq_lens = [1, 30, 300, 40, 8, 129, 700]
    meta, q, kc, vc = _batch(query_lens, seq_lens, block_size, heads, kv_heads, d, seed=heads * d + block_size)
    want = reference.paged_attention(q, kc, vc, meta, d**-0.5, window)
    meta.backend_state.clear()
    got = cpu_attention.paged_attention(q, kc, vc, meta, d**-0.5, window)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    long = slice(sum(query_lens[:3]), sum(query_lens[:4]))  # the 33-token chunk: torch's attention, bit for bit
    assert torch.equal(got[long], want[long])


def test_a_rows_attention_does_not_depend_on_its_batch():
    meta, q, kc, vc = _batch([1, 3, 1], [50, 20, 400], 16, 9, 3, 64, seed=7)
    torch.set_num_threads(2)
    together = cpu_attention.paged_attention(q, kc, vc, meta, 0.125)
    alone = AttentionMetadata.build(
        query_lens=[1], seq_lens=[400], block_tables=[meta.block_tables[2, :25].tolist()], block_size=16
    )
    assert torch.equal(cpu_attention.paged_attention(q[4:5], kc, vc, alone, 0.125), together[4:5])


def test_the_kv_write_copies_rows_skips_padding_and_refuses_a_slot_beyond_the_cache():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 3 * 2 * 8, generator=g)  # k and v views of one row, as the model's fused qkv
    k, v = kv[:, :24].view(5, 3, 8), kv[:, 24:].view(5, 3, 8)
    slots = torch.tensor([7, 0, 31, 12, 3])
    caches = [torch.zeros(4, 8, 3, 8) for _ in range(4)]
    reference.write_kv_cache(k, v, caches[0], caches[1], slots)
    cpu_attention.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    padded = slots.clone()
    padded[1] = -1
    kc, vc = torch.zeros(4, 8, 3, 8), torch.zeros(4, 8, 3, 8)
    cpu_attention.write_kv_cache(k, v, kc, vc, padded, has_padding=True)
    assert not kc.view(32, 3, 8)[0].any() and torch.equal(kc.view(32, 3, 8)[7], k[0])
    kc, vc = torch.zeros(4, 8, 3, 8), torch.zeros(4, 8, 3, 8)
    with pytest.raises(IndexError, match="slot 32 is beyond the cache's 32"):
        cpu_attention.write_kv_cache(k, v, kc, vc, torch.tensor([7, 0, 32, 12, 3]))
    assert not kc.any() and not vc.any()  # nothing written


def test_both_fall_back_to_the_twins(monkeypatch):
    meta, q, kc, vc = _batch([1, 2], [10, 20], 16, 4, 2, 8, seed=1)
    want = reference.paged_attention(q, kc, vc, meta, 0.3)
    wide = (q.double(), kc.double(), vc.double(), meta, 0.3)
    assert torch.equal(cpu_attention.paged_attention(*wide), reference.paged_attention(*wide))
    meta6, q6, kc6, vc6 = _batch([1, 2], [10, 20], 16, 4, 2, 6, seed=1)  # head size not a multiple of 8
    assert torch.equal(
        cpu_attention.paged_attention(q6, kc6, vc6, meta6, 0.3), reference.paged_attention(q6, kc6, vc6, meta6, 0.3)
    )
    out = cpu_attention.paged_attention(q.clone().requires_grad_(), kc, vc, meta, 0.3)
    assert out.requires_grad
    monkeypatch.setenv(cpu_matmul.ENV, "0")
    meta.backend_state.clear()
    assert torch.equal(cpu_attention.paged_attention(q, kc, vc, meta, 0.3), want)
    k = torch.randn(2, 2, 8)
    caches = [torch.zeros(2, 16, 2, 8) for _ in range(2)]
    cpu_attention.write_kv_cache(k, k, *caches, torch.tensor([3, 20]))
    assert torch.equal(caches[0].view(32, 2, 8)[20], k[1])


def _runner(quantization=None):
    loaded = load_model(default_model_path(), quantization=quantization)
    return ModelRunner(loaded, KVCache(loaded.kv_config, 16, 16, torch.float32, "cpu"))


def _steps(runner):
    """Logits of a prompt chunk, two decode steps of two sequences, then a verify step of 1 + 4 tokens."""
    blocks_a, blocks_b = list(range(8)), list(range(8, 16))
    out = [runner.run([SequenceChunk(list(range(40, 70)), 0, blocks_a, 30), SequenceChunk([5, 6, 7], 0, blocks_b, 3)])]
    for i in range(2):
        out.append(
            runner.run([SequenceChunk([100 + i], 30 + i, blocks_a, 1), SequenceChunk([9 + i], 3 + i, blocks_b, 1)])
        )
    out.append(runner.run([SequenceChunk([11, 12, 13, 14, 15], 32, blocks_a, 5)]))
    return torch.cat(out)


def test_the_fused_layer_gives_the_module_paths_logits(monkeypatch):
    runs = []
    forward = cpu_layer.forward
    monkeypatch.setattr(cpu_layer, "forward", lambda *a: runs.append(1) or forward(*a))
    fused = _steps(_runner())
    assert len(runs) == 4  # every step (the 30-token chunk too: at most SHORT_QUERY_MAX new tokens each)
    monkeypatch.setattr(cpu_layer, "plan", lambda *a: None)
    modules = _steps(_runner())
    assert len(runs) == 4
    torch.testing.assert_close(fused, modules, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.argmax(-1), modules.argmax(-1))


def test_the_fused_layer_returns_the_feature_layers_streams(monkeypatch):
    runner = _runner()
    runner.model.feature_layers = (0, 2)
    blocks = list(range(4))
    fused = runner.run_hidden([SequenceChunk([3, 4, 5], 0, blocks, 3)])[1]
    monkeypatch.setattr(cpu_layer, "plan", lambda *a: None)
    runner2 = _runner()
    runner2.model.feature_layers = (0, 2)
    modules = runner2.run_hidden([SequenceChunk([3, 4, 5], 0, blocks, 3)])[1]
    assert fused.shape == modules.shape == (3, 3 * runner.model.config.hidden_size)
    torch.testing.assert_close(fused, modules, rtol=1e-4, atol=1e-4)


def test_the_fused_layer_follows_a_new_packing_of_the_weights():
    runner = _runner()
    model = runner.model
    before = _steps(runner)
    built = model._fused_layers  # noqa: SLF001
    assert built is not None and built.layers is not None
    model.quantize("int8")  # every projection repacked: the structures must point at the new codes
    after = _steps(_runner_over(model))
    assert model._fused_layers is not built  # noqa: SLF001
    reference_int8 = _steps(_runner(quantization="int8"))
    torch.testing.assert_close(after, reference_int8, rtol=1e-4, atol=1e-4)
    assert not torch.equal(after, before)


def _runner_over(model):
    loaded = load_model(default_model_path())
    loaded.model = model
    return ModelRunner(loaded, KVCache(loaded.kv_config, 16, 16, torch.float32, "cpu"))


def test_the_fused_layer_steps_aside_where_it_does_not_apply():
    loaded = load_model(default_model_path())
    model = loaded.model
    meta = AttentionMetadata.build(query_lens=[1], seq_lens=[5], block_tables=[[0]], block_size=16)
    x = torch.randn(1, model.config.hidden_size)
    backend = get_attention_backend("cpu")
    assert cpu_layer.plan(model, x, meta, backend) is not None
    assert cpu_layer.plan(model, x, meta, get_attention_backend("cpu", prefer_reference=True)) is None
    assert cpu_layer.plan(model, x.double(), meta, backend) is None
    with torch.enable_grad():
        assert cpu_layer.plan(model, x.clone().requires_grad_(), meta, backend) is None
    long = AttentionMetadata.build(query_lens=[40], seq_lens=[40], block_tables=[[0, 1, 2]], block_size=16)
    assert cpu_layer.plan(model, torch.randn(40, model.config.hidden_size), long, backend) is None
    half = [(torch.zeros(4, 16, 4, 32, dtype=torch.float16),) * 2]
    assert cpu_layer.plan(model, x, meta, backend, half) is None  # a float16 cache
    model.layers[1].mlp.down_proj.set_cpu_layout(None)  # one projection torch's: the modules run
    assert cpu_layer.plan(model, x, meta, backend) is None
