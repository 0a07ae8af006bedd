"""The CPU kernel library's other ops (worker/model/cpu_matmul.py, cpu_matmul.cpp), used by
the Llama model on CPU:

- RoPE in place on the q/k part of the fused qkv product: bit-identical to ``apply_rope``
  for 1-20 rows, any row stride, odd half-widths (the scalar tail);
- RMSNorm with and without the residual add, registered as the ``rms_norm`` op for CPU: the
  residual sum bit-identical, the normed rows within float32 rounding of the torch twin, for
  prompt-sized inputs (threads) too;
- both fall back to torch where they do not apply (gradients, another dtype, the kernel off)
  with the same results, and a model forward pass gives the same logits with them on and off.
"""

from __future__ import annotations

import pytest
import torch

from draftwise.kernels import dispatch, reference
from draftwise.worker import default_model_path
from draftwise.worker.model import cpu_matmul
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
from draftwise.worker.model.rope import apply_rope


@pytest.mark.parametrize("d", [64, 48, 10])
@pytest.mark.parametrize("rows", [1, 2, 5, 20])
def test_rope_in_place_is_bit_identical_to_torchs(rows, d):
    g = torch.Generator().manual_seed(rows * 100 + d)
    heads, kv = 9, 3
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=g) * 4
    qk = qkv[:, : (heads + kv) * d].view(rows, heads + kv, d)  # rows strided by the whole qkv width
    cos, sin = torch.randn(rows, 1, d, generator=g), torch.randn(rows, 1, d, generator=g)
    expected = apply_rope(qk.clone(), cos, sin)
    v_before = qkv[:, (heads + kv) * d :].clone()
    assert cpu_matmul.rope_(qk, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv) * d :], v_before)  # v untouched


def test_rope_declines_what_it_cannot_do_in_place(monkeypatch):
    x = torch.randn(2, 3, 8)
    cos, sin = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    before = x.clone()
    assert not cpu_matmul.rope_(x.double(), cos.double(), sin.double())  # another dtype
    assert not cpu_matmul.rope_(x.clone().requires_grad_(), cos, sin)  # gradients
    assert not cpu_matmul.rope_(x.transpose(0, 1), cos[:1].expand(3, 1, 8), sin[:1].expand(3, 1, 8))  # layout
    monkeypatch.setenv(cpu_matmul.ENV, "0")
    assert not cpu_matmul.rope_(x, cos, sin)
    assert torch.equal(x, before)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 576), (7, 40), (300, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_twin(rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows + hidden)
    x, w = torch.randn(rows, hidden, generator=g) * 3, torch.randn(hidden, generator=g)
    res = torch.randn(rows, hidden, generator=g) if with_residual else None
    torch.set_num_threads(2)
    out, r = cpu_matmul.rms_norm(x, w, 1e-5, res)
    ref_out, ref_r = reference.rms_norm(x, w, 1e-5, res)
    assert torch.equal(r, ref_r)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    one, _ = cpu_matmul.rms_norm(x[-1:], w, 1e-5, None if res is None else res[-1:])
    assert torch.equal(one[0], out[-1])  # a row's result does not depend on its batch


def test_rms_norm_falls_back_to_the_twin(monkeypatch):
    x, w = torch.randn(2, 16), torch.randn(16)
    grad = x.clone().requires_grad_()
    out, _ = cpu_matmul.rms_norm(grad, w, 1e-5)
    assert out.requires_grad  # torch's op, differentiable
    out64, _ = cpu_matmul.rms_norm(x.double(), w.double(), 1e-5)
    assert torch.equal(out64, reference.rms_norm(x.double(), w.double(), 1e-5)[0])
    with pytest.raises(RuntimeError):  # mismatched shapes go to torch's op, which refuses them (no read past the end)
        cpu_matmul.rms_norm(x, torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError):
        cpu_matmul.rms_norm(x, w, 1e-5, torch.randn(1, 8))
    monkeypatch.setenv(cpu_matmul.ENV, "0")
    assert torch.equal(cpu_matmul.rms_norm(x, w, 1e-5)[0], reference.rms_norm(x, w, 1e-5)[0])


def _decode_logits(path) -> torch.Tensor:
    """The default target's logits over a prompt, then for 5 one-token decode steps."""
    loaded = load_model(path)
    runner = ModelRunner(loaded, KVCache(loaded.kv_config, 8, 16, torch.float32, "cpu"))
    prompt = list(range(40, 90))
    out = [runner.run([SequenceChunk(prompt, 0, list(range(8)), num_logits=len(prompt))])]
    for i in range(5):
        out.append(runner.run([SequenceChunk([100 + i], len(prompt) + i, list(range(8)), num_logits=1)]))
    return torch.cat(out)


def test_rms_norm_is_the_cpu_op_and_a_forward_pass_agrees_with_the_ops_off(monkeypatch):
    assert dispatch.backend_name("rms_norm", "cpu") == "draftwise-cpu"
    assert dispatch.impl("rms_norm", "cpu", prefer_reference=True) is reference.rms_norm
    assert load_model(default_model_path()).model.norm._impl is cpu_matmul.rms_norm  # noqa: SLF001
    ropes: list[bool] = []
    rope_ = cpu_matmul.rope_
    monkeypatch.setattr(cpu_matmul, "rope_", lambda *a: ropes.append(rope_(*a)) or ropes[-1])
    on = _decode_logits(default_model_path())
    assert ropes and all(ropes), ropes  # every layer of every pass rotated in place
    monkeypatch.setenv(cpu_matmul.ENV, "0")  # torch's norms, RoPE and products
    off = _decode_logits(default_model_path())
    assert on.shape == off.shape == (55, on.shape[1])
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    assert torch.equal(on.argmax(-1), off.argmax(-1))
