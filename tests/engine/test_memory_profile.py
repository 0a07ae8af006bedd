"""The memory profile that sizes a CUDA worker's KV cache probes every kind of step at its
worst (worker/engine/memory_profile.py): the probes' shapes, and the probes run on the real
default target and draft models with a real measure of tensor memory on CPU (every tensor
an op creates, alive until its storage is freed: what CUDA's allocator counts as allocated).

The profile used to run one prefill chunk only; the widest verify step of a batch (logits
and sampler copies of every drafted position, the draft's distributions held) and the
draft's catch-up were not in it. The second test shows the verify probe outweighs the
prefill on a realistic configuration, so the old profile left too little room.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from draftwise.worker import default_model_path
from draftwise.worker.engine.memory_profile import MemoryProfile, Probe, plan_probes, profile_activations
from draftwise.worker.model.loader import load_model


class TensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages ops create while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self._seen:
                    self._seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, n)
        return out


def tensor_peak_bytes(fn) -> int:  # noqa: ANN001
    """The measure profile_activations takes, on CPU: peak tensor bytes while ``fn`` runs,
    less the bytes it returns (its probe KV cache)."""
    mode = TensorBytes()
    with mode:
        excluded = fn()
    return max(0, mode.peak - excluded)


def test_plan_covers_every_kind_of_step():
    plain = plan_probes(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)
    assert [p.name for p in plain] == ["prefill", "decode"]
    prefill, decode = plain
    assert (prefill.num_seqs, prefill.tokens_per_seq, prefill.logits_per_seq) == (1, 2048, 1)
    assert (decode.num_seqs, decode.tokens_per_seq, decode.context, decode.sample) == (64, 1, 4096, True)

    ngram = plan_probes(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096, spec_k=4)
    assert [p.name for p in ngram] == ["prefill", "decode", "verify"]
    verify = ngram[2]
    assert (verify.num_seqs, verify.tokens_per_seq, verify.logits_per_seq, verify.draft_k) == (64, 5, 5, 4)
    assert verify.context == 4096 and verify.sample

    draft = plan_probes(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=1024, spec_k=5, draft_model=True)
    names = [p.name for p in draft]
    assert names == ["prefill", "decode", "verify", "draft catch-up", "draft propose"]
    by = {p.name: p for p in draft}
    assert by["verify"].num_seqs == 512 // 6  # the token budget caps the sequences of a verify step
    assert (by["draft catch-up"].model, by["draft catch-up"].num_tokens, by["draft catch-up"].logits_per_seq) == (
        "draft",
        512,
        0,
    )
    assert (by["draft propose"].num_seqs, by["draft propose"].context) == (256, 1024)
    short = plan_probes(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=256)
    assert short[0].tokens_per_seq == 256  # a chunk never outgrows max_model_len


@pytest.fixture(scope="module")
def models():
    return load_model(default_model_path("target"), dtype="float32"), load_model(
        default_model_path("draft"), dtype="float32"
    )


def test_probes_run_and_verify_outweighs_prefill(models):
    target, draft = models
    seqs, k, budget, ctx = 32, 5, 256, 512
    probes = plan_probes(
        max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=ctx, spec_k=k, draft_model=True
    )
    prof = profile_activations(target, draft, probes, 16, tensor_peak_bytes, graphs=True)
    print({n: v >> 10 for n, v in prof.peaks.items()}, prof.graph_pool >> 10)
    assert set(prof.peaks) == {p.name for p in probes}
    assert all(v > 0 for v in prof.peaks.values())
    vocab = target.config.vocab_size
    verify = next(p for p in probes if p.name == "verify")
    rows = verify.num_seqs * (1 + k)
    # the logits, the verifier's distributions and the draft's held q: three [rows, vocab] float32 at least
    assert prof.peaks["verify"] >= 3 * rows * vocab * 4
    assert prof.peaks["verify"] > prof.peaks["prefill"]  # what the prefill-only profile missed
    assert prof.peaks["decode"] >= seqs * vocab * 4
    assert 0 < prof.graph_pool < prof.peaks["verify"]  # the forward pass without the sampler
    assert prof.activations == max(prof.peaks.values()) + prof.graph_pool
    eager = profile_activations(target, draft, probes[:2], 16, tensor_peak_bytes)
    assert eager.graph_pool == 0 and eager.activations == max(eager.peaks.values())


def test_profile_refuses_a_draft_probe_without_a_draft(models):
    target, _ = models
    with pytest.raises(ValueError, match="draft"):
        profile_activations(target, None, [Probe("draft catch-up", "draft", 1, 8, 8, 0)], 16, tensor_peak_bytes)
    assert MemoryProfile().activations == 0
