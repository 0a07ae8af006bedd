"""On CPU the model stores each projection's weight ``[in, out]`` in memory (the parameter
an ``[out, in]`` view of it): the same values as the checkpoint, the same logits within float32
rounding, the same greedy tokens, whichever layout and however many rows."""

from __future__ import annotations

import torch
from torch import nn

from draftwise.worker import default_model_path
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _decode(loaded, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of every prompt decoded together, and the first step's logits."""
    per_seq = 8
    runner = ModelRunner(loaded, KVCache(loaded.config, per_seq * len(prompts), 16, torch.float32, "cpu"))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits = runner.run([SequenceChunk(p, 0, t, num_logits=1) for p, t in zip(prompts, tables, strict=True)])
    first = logits.clone()
    out = [[] for _ in prompts]
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks, strict=True):
            o.append(t)
        logits = runner.run([SequenceChunk([t], p, tb) for t, p, tb in zip(toks, pos, tables, strict=True)])
        pos = [p + 1 for p in pos]
    return out, first


def test_cpu_load_stores_weights_in_out_with_the_checkpoint_values() -> None:
    loaded = load_model(default_model_path("target"), dtype="float32")
    model = loaded.model
    linears = _linears(model)
    assert linears, "the model has projections"
    for m in linears:
        assert not m.weight.is_contiguous() and m.weight.t().is_contiguous(), m
    head = model._lm_head_in_out
    assert head is not None and head.is_contiguous()
    assert torch.equal(head.t(), model.embed_tokens.weight)  # tied: the copy holds the embedding's values
    before = [m.weight.clone() for m in linears]
    model.store_weights_in_out(False)
    for m, w in zip(linears, before, strict=True):
        assert m.weight.is_contiguous() and torch.equal(m.weight, w)
    assert model._lm_head_in_out is None


def test_both_layouts_decode_the_same_tokens() -> None:
    prompts = [[1, 5, 9, 300, 41, 7], [1, 2000, 17], [1, 77, 78, 79, 80, 81, 82, 83, 84, 85]]
    a = load_model(default_model_path("target"), dtype="float32")
    b = load_model(default_model_path("target"), dtype="float32")
    b.model.store_weights_in_out(False)
    toks_a, logits_a = _decode(a, prompts, 24)
    toks_b, logits_b = _decode(b, prompts, 24)
    assert (logits_a - logits_b).abs().max().item() < 1e-4
    assert toks_a == toks_b
    # one row alone decodes what it decodes in the batch
    alone, _ = _decode(a, prompts[1:2], 24)
    assert alone[0] == toks_a[1]
