"""EAGLE and Medusa heads (proposers that read the target's hidden states) change nothing in
what the engine outputs.

- greedy: the trained heads shipped for the embedded target, batched under chunked prefill
  and forced preemption, give token for token what plain greedy gives alone, with drafts
  both accepted and rejected, and every pool (target and EAGLE) empty when idle;
- seeded sampling: equal to plain seeded sampling (Gumbel coupling), request by request;
- the training twin (``EagleHead.train_forward``) computes what the engine's paged path does;
- a head trained for another target is refused in one line; a target with no shipped head
  is told what is shipped; a bad head folder is refused before the target loads;
- failures: a proposal that fails fails its request only (the others finish exactly, all
  blocks freed); an observation that fails only stops that request's speculation.

The sampled-distribution (chi-square) check is in ``test_spec_distribution.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from draftwise.worker import default_model_path
from draftwise.worker.core.block_manager import BlockManager
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model.chunk import SequenceChunk
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.model.rope import RotaryEmbedding
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.heads import (
    EagleHead,
    HeadConfig,
    LoadedHead,
    MedusaHeads,
    draft_lm_head,
    find_head,
    fingerprints_match,
    head_model_config,
    load_head,
    save_head,
    target_fingerprint,
)
from draftwise.worker.speculative.hidden import EagleProposer, MedusaProposer
from tests.engine.test_spec_exactness import _config, _requests, run_alone, run_together

METHODS = ["eagle", "medusa"]


@pytest.fixture(scope="module")
def workload():
    reqs = _requests(64, seed=5)
    return reqs, run_alone(reqs)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_exact_batched_with_chunked_prefill_and_preemption(workload, method, k):
    reqs, alone = workload
    engine = LLMEngine(
        _config(
            block_size=16,
            max_num_batched_tokens=48,
            max_num_seqs=12,
            num_kv_blocks=40,  # 640 tokens: forces preemption
            speculative_method=method,
            num_speculative_tokens=k,
            speculative_adaptive=False,
        )
    )
    together = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0, "the workload did not force any preemption"
    mismatched = [rid for rid in alone if together[rid] != alone[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
    totals = engine.spec_totals
    assert 0 < totals["accepted"] < totals["proposed"], totals
    engine.check_idle_invariants()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_alone_is_exact(workload, method):
    reqs, alone = workload
    engine = LLMEngine(_config(num_kv_blocks=64, speculative_method=method))
    for rid, prompt, params, _ in reqs[:12]:
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                assert o.outputs[0].token_ids == alone[o.request_id], o.request_id
            engine.check_invariants()
    engine.check_idle_invariants()


def _seeded(method: str | None) -> dict[str, list[int]]:
    spec = {} if method is None else {"speculative_method": method, "num_speculative_tokens": 4}
    engine = LLMEngine(_config(num_kv_blocks=256, **spec))
    rng = random.Random(3)
    for i in range(16):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True, seed=100 + i)
        engine.add_request(f"s{i}", prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            out[o.request_id] = o.outputs[0].token_ids
    engine.check_idle_invariants()
    if method is not None:
        assert engine.spec_totals["accepted"] > 0, engine.spec_totals
    return out


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_equals_plain_seeded(method):
    assert _seeded(method) == _seeded(None)


def test_train_forward_matches_the_paged_engine_path():
    target = load_model(default_model_path("target"), dtype="float32")
    torch.manual_seed(0)
    head = EagleHead(head_model_config(target.config))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    head.requires_grad_(False)
    ids = torch.arange(target.config.vocab_size)
    lm_head = target.model._embedding_dense()  # noqa: SLF001
    loaded = LoadedHead(HeadConfig("eagle", "t", {}, ids.numel()), Path("."), head, ids, draft_lm_head(lm_head))
    prop = EagleProposer(loaded, target.model, target.config.vocab_size, num_blocks=16, block_size=16)
    n = 37
    toks = torch.randint(3, 4000, (n,))
    feats = torch.randn(n, target.config.hidden_size)
    rope = RotaryEmbedding(target.config.rope, target.config.head_dim, 512)
    want = head.train_forward(target.model._embed(toks)[None], feats[None], rope)[0]  # noqa: SLF001
    table: list[int] = []
    blocks = BlockManager(16, 16)
    assert blocks.grow(table, n)
    got1 = prop._run([SequenceChunk(toks[:20].tolist(), 0, table, 0)], feats[:20])  # noqa: SLF001
    got2 = prop._run([SequenceChunk(toks[20:].tolist(), 20, table, 0)], feats[20:])  # noqa: SLF001
    torch.testing.assert_close(torch.cat([got1, got2]), want, atol=2e-4, rtol=2e-4)
    # training-time test: pass j at position i is drafting position j at t = i - j + 1, which
    # the engine computes over the real features up to t and its own drafts after it
    emb = target.model._embed(toks)[None]  # noqa: SLF001
    g1, kv1 = head.train_pass(emb, feats[None], rope, [])
    shift = lambda g: torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # noqa: E731
    g2, kv2 = head.train_pass(emb, shift(g1), rope, [kv1])
    g3, _ = head.train_pass(emb, shift(g2), rope, [kv1, kv2])
    for t in (5, 20, 33):
        table = []
        assert blocks.grow(table, t + 3)
        real = prop._run([SequenceChunk(toks[: t + 1].tolist(), 0, table, 0)], feats[: t + 1])  # noqa: SLF001
        d2 = prop._run([SequenceChunk([int(toks[t + 1])], t + 1, table, 0)], real[-1:])  # noqa: SLF001
        d3 = prop._run([SequenceChunk([int(toks[t + 2])], t + 2, table, 0)], d2)  # noqa: SLF001
        torch.testing.assert_close(d2[0], g2[0, t + 1], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(d3[0], g3[0, t + 2], atol=2e-4, rtol=2e-4)
        blocks.free(table)


def test_a_head_for_another_target_is_refused_in_one_line(tmp_path):
    embedded = load_model(default_model_path("target"), dtype="float32")
    other = load_model(default_model_path("draft"), dtype="float32")
    heads = MedusaHeads(other.config.hidden_size, 2)
    save_head(tmp_path / "h", heads, torch.arange(64), "the embedded draft", other.model)
    with pytest.raises(ModelLoadError) as e:
        load_head(tmp_path / "h", embedded.model, torch.float32, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "trained for the embedded draft" in msg and "not for the target being served" in msg
    with pytest.raises(ModelLoadError, match="no medusa head was trained for this target"):
        find_head("medusa", target_fingerprint(other.model))
    with pytest.raises(ModelLoadError, match="not a draft head folder"):
        LLMEngine(_config(speculative_method="eagle", speculative_model=str(tmp_path)))


@pytest.mark.parametrize("method", METHODS)
def test_a_failed_proposal_fails_its_request_only(workload, method, monkeypatch):
    reqs, alone = workload
    cls = EagleProposer if method == "eagle" else MedusaProposer
    real = cls.propose

    def propose(self, rs, ks):
        if any(r.request_id == "r3" for r in rs):
            raise RuntimeError("planted proposal failure")
        return real(self, rs, ks)

    monkeypatch.setattr(cls, "propose", propose)
    # not adaptive: the cost layer, timing a loaded machine, may otherwise never draft for r3 (CI saw it)
    engine = LLMEngine(_config(num_kv_blocks=64, speculative_method=method, max_num_seqs=8, speculative_adaptive=False))
    finals: dict = {}
    out = run_together(reqs[:16], engine, finals)
    assert finals["r3"].error is not None and "planted proposal failure" in finals["r3"].error
    assert all(out[rid] == alone[rid] for rid in out if rid != "r3")
    engine.check_idle_invariants()


def test_a_failed_observation_only_stops_speculating(workload, monkeypatch):
    reqs, alone = workload
    real = EagleProposer.observe

    def observe(self, items):
        if any(it.request.request_id == "r2" for it in items):
            raise RuntimeError("planted observation failure")
        return real(self, items)

    monkeypatch.setattr(EagleProposer, "observe", observe)
    engine = LLMEngine(_config(num_kv_blocks=64, speculative_method="eagle", max_num_seqs=8))
    finals: dict = {}
    out = run_together(reqs[:16], engine, finals)
    assert out == {rid: alone[rid] for rid in out} and len(out) == 16
    assert all(f.error is None for f in finals.values())
    assert not finals["r2"].outputs[0].num_spec_proposed
    assert engine.spec_totals["proposed"] > 0
    engine.check_idle_invariants()


def test_a_head_fits_its_target_in_another_dtype():
    """The shipped head is found for the embedded target loaded in bfloat16 too (its
    embedding checksum may move a little), and not for a target of another shape or embedding."""
    f32 = target_fingerprint(load_model(default_model_path("target"), dtype="float32").model)
    bf16 = target_fingerprint(load_model(default_model_path("target"), dtype="bfloat16").model)
    assert fingerprints_match(f32, bf16)
    assert find_head("eagle", bf16).name == "default-eagle"
    assert not fingerprints_match(f32, {**f32, "hidden_size": 1 + int(f32["hidden_size"])})
    assert not fingerprints_match(f32, {**f32, "embedding_checksum": 1.1 * float(f32["embedding_checksum"])})
