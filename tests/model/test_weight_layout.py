"""On CPU the model lays each projection's weight out for the CPU kernel (panels of 16 columns,
worker/model/cpu_matmul.py) or, without it, for torch's products on its threads (``[in, out]``
for one, column blocks multiplied as one batched product for several): the checkpoint's values, the
same logits within float32 rounding (against the exact float64 values, ``tests/numerics.py``), the same greedy tokens, whichever layout and however many
rows; and a row decoded alone gives what it gives in a batch."""

from __future__ import annotations

import functools

import pytest
import torch

from draftwise.worker import default_model_path
from draftwise.worker.model import cpu_matmul
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.llama import Linear
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
from tests.model.hf_utils import exact_copy, hf_logits
from tests.numerics import assert_float32_agrees

PROMPTS = [[1, 5, 9, 300, 41, 7], [1, 2000, 17], [1, 77, 78, 79, 80, 81, 82, 83, 84, 85]]


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


def _assert_linear_exact(m: Linear, x: torch.Tensor, what: object) -> None:
    """``m(x)`` against the float64 product, bounded by the error of torch's own float32
    products over either layout (``[out, in]`` and ``[in, out]``: BLAS kernels differ)."""
    w = m.dense_weight()
    exact = x.double() @ w.double().t()
    yardsticks = torch.nn.functional.linear(x, w), x @ w.t().contiguous()
    assert_float32_agrees(m(x), exact, *yardsticks, what=str(what))


@functools.cache
def _hf_target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_model_path("target"), dtype=torch.float32, local_files_only=True
    ).eval()


def _hf_last_logits(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [len(prompts), vocab]
    """transformers' last-position logits of each prompt: exact (float64) and float32."""
    hf = _hf_target()
    exact = exact_copy(hf)
    return (
        torch.stack([hf_logits(exact, p)[-1] for p in prompts]),
        torch.stack([hf_logits(hf, p)[-1] for p in prompts]),
    )


def _target(parts: int | None):
    loaded = load_model(default_model_path("target"), dtype="float32")
    loaded.model.set_cpu_layout(parts)
    return loaded


@pytest.mark.parametrize("kernels", ["draftwise", "torch"])
def test_cpu_load_lays_weights_out_for_the_threads(kernels: str, monkeypatch) -> None:
    """The CPU kernel's panels where it runs (it does on this machine); with
    DRAFTWISE_CPU_KERNELS=0, torch's layouts for the thread count."""
    if kernels == "torch":
        monkeypatch.setenv(cpu_matmul.ENV, "0")
    else:
        assert cpu_matmul.kernel() is not None, cpu_matmul.unavailable_reason()
    threads = torch.get_num_threads()
    model = load_model(default_model_path("target"), dtype="float32").model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears, "the model has projections"
    for m in linears:
        if kernels == "draftwise":
            panel = cpu_matmul.PANEL
            assert m.panels and m.weight.shape == (m.out_features // panel, panel, m.in_features)
            assert m.weight.transpose(1, 2).is_contiguous()
        elif threads == 1:
            assert m.weight.dim() == 2 and m.weight.t().is_contiguous()
        else:
            assert m.weight.shape == (threads, m.out_features // threads, m.in_features)
            assert m.weight.transpose(1, 2).is_contiguous()
    # tied: the LM head is laid out too, and the embedding reads the same storage (no second copy)
    head = model._lm_head
    assert head is not None and head.weight is model.embed_tokens.weight
    checkpoint = load_model(default_model_path("target"), dtype="float32").model
    checkpoint.set_cpu_layout(None)
    assert torch.equal(head.dense_weight(), checkpoint.embed_tokens.weight)
    ids = torch.tensor([0, 1, 2, 4095, 4096, 8191, 17, 17])
    assert torch.equal(model._embed(ids), checkpoint.embed_tokens.weight[ids])
    # the model's parameters (and weight bytes) are the checkpoint's: nothing is held twice
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in checkpoint.parameters())
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))


def test_blocks_divide_the_columns_and_are_not_too_narrow(monkeypatch) -> None:
    monkeypatch.setenv(cpu_matmul.ENV, "0")  # torch's column blocks
    for out, parts, want in [
        (256, 2, 2),
        (256, 3, 2),
        (256, 4, 4),
        (256, 64, 4),
        (8192, 64, 8),
        (96, 2, 1),
        (1536, 7, 6),
        (10, 2, 1),
    ]:
        m = Linear(8, out, bias=False)
        m.set_cpu_layout(parts)
        got = 1 if m.weight.dim() == 2 else m.weight.shape[0]
        assert got == want, (out, parts, got)
        x = torch.randn(3, 8)
        _assert_linear_exact(m, x, (out, parts))
    monkeypatch.delenv(cpu_matmul.ENV)  # the kernel's panels: whole panels of 16 columns, any parts
    for out, parts, want in [(256, 1, 16), (256, 3, 16), (96, 2, 6), (10, 2, 1), (40, 2, 1)]:
        m = Linear(8, out, bias=False)
        m.set_cpu_layout(parts)
        got = 1 if m.weight.dim() == 2 else m.weight.shape[0]
        assert got == want and m.panels == (want > 1), (out, parts, got)
        _assert_linear_exact(m, torch.randn(3, 8), (out, parts))


@pytest.mark.parametrize(
    ("parts", "kernels"),
    [(None, "torch")] + [(p, k) for p in (1, 2, 3, 4) for k in ("draftwise", "torch")],  # None: the checkpoint's
)
def test_every_layout_holds_the_checkpoint_values(parts: int | None, kernels: str, monkeypatch) -> None:
    if kernels == "torch":
        monkeypatch.setenv(cpu_matmul.ENV, "0")
    ref = _target(None).model
    model = _target(parts).model
    for (name, a), (_, b) in zip(ref.named_modules(), model.named_modules(), strict=True):
        if isinstance(a, Linear):
            assert torch.equal(a.dense_weight(), b.dense_weight()), name
            x = torch.randn(5, a.in_features)
            _assert_linear_exact(b, x, name)
            assert b(x[:0]).shape == (0, a.out_features), name  # no rows (a chunk that asks for no logits)
    assert ref._lm_head is None and (parts is None) == (model._lm_head is None)
    ids = torch.arange(ref.config.vocab_size)
    assert torch.equal(model._embed(ids), ref._embed(ids))
    back = _target(parts).model
    back.set_cpu_layout(None)  # and back to the checkpoint's layout
    assert torch.equal(back.embed_tokens.weight, ref.embed_tokens.weight) and back._lm_head is None


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_layouts_decode_the_same_tokens_batched_and_alone(parts: int) -> None:
    toks_ref, logits_ref = _decode(_target(None), PROMPTS, 24)
    laid_out = _target(parts)
    toks, logits = _decode(laid_out, PROMPTS, 24)
    exact, yardstick = _hf_last_logits(PROMPTS)
    for layout, got in ((None, logits_ref), (parts, logits)):
        assert_float32_agrees(got, exact, yardstick, what=f"layout {layout}")
    assert toks == toks_ref
    for i, p in enumerate(PROMPTS):
        alone, _ = _decode(laid_out, [p], 24)
        assert alone[0] == toks[i]
