"""EAGLE-3's fused features: an EAGLE head that reads earlier layers' streams beside the
target's final hidden state (``HeadConfig.feature_layers``).

- the target's forward returns those streams after the final state (the residual stream after
  each layer, as a hook on the layer sees it) and its logits do not change;
- a fused head whose fusion is the final state alone drafts exactly what the head it came
  from drafts (same proposals, same acceptances, same output), so the engine hands the
  streams to the fusion in the right order and shape;
- a head that really mixes the streams in stays exact (greedy equals plain, batched under
  chunked prefill and preemption, pools empty when idle) and drafts differently;
- the training twin over fused rows computes what the engine's paged path does;
- a head naming layers the target does not have is refused in one line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftwise.worker import default_model_path
from draftwise.worker.core.block_manager import BlockManager
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model.chunk import SequenceChunk
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.model.model_runner import ModelRunner
from draftwise.worker.model.rope import RotaryEmbedding
from draftwise.worker.paths import HEADS_DIR
from draftwise.worker.speculative.heads import (
    EagleHead,
    HeadConfig,
    LoadedHead,
    draft_lm_head,
    head_model_config,
    load_head,
    save_head,
)
from draftwise.worker.speculative.hidden import EagleProposer
from tests.engine.test_spec_exactness import _config, _requests, run_alone, run_together

LAYERS = (0, 2)


def _fused_head(folder: Path, mix: float) -> Path:
    """The shipped embedded EAGLE head with feature layers LAYERS added, its fusion the final
    state plus ``mix`` times a fixed random map of the streams, saved in ``folder``."""
    target = load_model(default_model_path("target"), dtype="float32")
    saved = load_file(str(HEADS_DIR / "default-eagle" / "head.safetensors"))
    ids = saved.pop("draft_ids").long()
    head = EagleHead(head_model_config(target.config), LAYERS)
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in saved.items()}, strict=False)
    assert missing == ["fuse.weight"] and not unexpected
    head.init_fuse()
    h = target.config.hidden_size
    with torch.no_grad():
        head.fuse.weight[:, h:] = mix * torch.randn(h, len(LAYERS) * h, generator=torch.Generator().manual_seed(0))
    save_head(folder, head, ids, "the embedded target", target.model)
    return folder


def test_the_target_returns_its_feature_layers_streams_after_the_final_state():
    loaded = load_model(default_model_path("target"), dtype="float32")
    model, h = loaded.model, loaded.config.hidden_size
    runner = ModelRunner(loaded, KVCache(loaded.config, 8, 16, loaded.dtype, loaded.device))
    toks = torch.randint(3, 4000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(3))
    plain_logits, plain = runner.run_hidden([SequenceChunk(toks, 0, table, 40)])
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        model.layers[i].register_forward_hook(lambda _m, _i, out, i=i: seen.__setitem__(i, out[0] + out[1]))
        for i in LAYERS
    ]
    model.feature_layers = LAYERS
    try:
        logits, wide = runner.run_hidden([SequenceChunk(toks, 0, table, 40)])
    finally:
        model.feature_layers = ()
        for hk in hooks:
            hk.remove()
    assert model.feature_width == h and wide.shape == (40, 3 * h)
    torch.testing.assert_close(wide[:, :h], plain)
    torch.testing.assert_close(logits, plain_logits)
    for j, i in enumerate(LAYERS):
        torch.testing.assert_close(wide[:, (j + 1) * h : (j + 2) * h], seen[i])
    assert not torch.equal(seen[0], seen[2])


def _run(reqs, speculative_model: str | None, preempt: bool) -> tuple[dict[str, list[int]], dict, LLMEngine]:
    sizing = {"block_size": 16, "max_num_batched_tokens": 48, "max_num_seqs": 12, "num_kv_blocks": 40}
    engine = LLMEngine(
        _config(
            **(sizing if preempt else {"num_kv_blocks": 256}),
            speculative_method="eagle",
            speculative_model=speculative_model,
            num_speculative_tokens=4,
            speculative_adaptive=False,
        )
    )
    out = run_together(reqs, engine)
    if preempt:
        assert engine.scheduler.num_preemptions > 0, "the workload did not force any preemption"
    engine.check_idle_invariants()
    return out, dict(engine.spec_totals), engine


def test_a_fusion_of_the_final_state_alone_drafts_what_the_head_did(tmp_path):
    reqs = _requests(16, seed=7)
    folder = _fused_head(tmp_path / "fused", mix=0.0)
    plain_out, plain_totals, _ = _run(reqs, None, preempt=False)
    out, totals, engine = _run(reqs, str(folder), preempt=False)
    assert engine.loaded.model.feature_layers == LAYERS
    assert out == plain_out
    for key in ("proposed", "accepted", "verify_steps"):
        assert totals[key] == plain_totals[key], (key, totals, plain_totals)
    assert totals["accepted"] > 0


def test_a_head_that_mixes_the_streams_in_stays_exact(tmp_path):
    reqs = _requests(48, seed=5)
    alone = run_alone(reqs)
    folder = _fused_head(tmp_path / "fused", mix=0.02)
    out, totals, _ = _run(reqs, str(folder), preempt=True)
    mismatched = [rid for rid in alone if out[rid] != alone[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
    assert 0 < totals["accepted"] < totals["proposed"], totals
    _, shipped, _ = _run(reqs, None, preempt=True)
    assert (totals["proposed"], totals["accepted"]) != (shipped["proposed"], shipped["accepted"])


def test_train_forward_over_fused_rows_matches_the_paged_engine_path(tmp_path):
    target = load_model(default_model_path("target"), dtype="float32")
    h = target.config.hidden_size
    torch.manual_seed(0)
    head = EagleHead(head_model_config(target.config), LAYERS)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    head.requires_grad_(False)
    ids = torch.arange(target.config.vocab_size)
    lm_head = draft_lm_head(target.model._embedding_dense())  # noqa: SLF001
    cfg = HeadConfig("eagle", "t", {}, ids.numel(), feature_layers=list(LAYERS))
    prop = EagleProposer(LoadedHead(cfg, Path("."), head, ids, lm_head), target.model, ids.numel(), 16, 16)
    n = 30
    toks = torch.randint(3, 4000, (n,))
    rows = 3 * torch.randn(n, 3 * h)  # the target's rows: final state, then two streams
    rope = RotaryEmbedding(target.config.rope, target.config.head_dim, 512)
    want = head.train_forward(target.model._embed(toks)[None], head.fused(rows)[None], rope)[0]  # noqa: SLF001
    table: list[int] = []
    assert BlockManager(16, 16).grow(table, n)
    got = prop._run([SequenceChunk(toks.tolist(), 0, table, 0)], head.fused(rows))  # noqa: SLF001
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    # the fused rows are not the final state alone: the streams count
    assert not torch.allclose(head.fused(rows), head.fused(torch.cat([rows[:, :h], 0 * rows[:, h:]], dim=1)))


def test_a_head_naming_layers_the_target_lacks_is_refused_in_one_line(tmp_path):
    folder = _fused_head(tmp_path / "fused", mix=0.0)
    dataclasses.replace(HeadConfig.read(folder), feature_layers=[0, 99]).write(folder)
    target = load_model(default_model_path("target"), dtype="float32")
    with pytest.raises(ModelLoadError) as e:
        load_head(folder, target.model, torch.float32, torch.device("cpu"))
    assert "\n" not in str(e.value) and "feature_layers [0, 99]" in str(e.value)
    assert target.model.feature_layers == ()


def test_loading_a_head_sets_the_target_streams_it_reads_and_only_those(tmp_path):
    """A fused EAGLE head makes the target hand over its layers' streams; a Medusa head loaded
    on the same target afterwards reads the final state alone, so the target stops."""
    folder = _fused_head(tmp_path / "fused", mix=0.0)
    target = load_model(default_model_path("target"), dtype="float32")
    load_head(folder, target.model, torch.float32, torch.device("cpu"))
    assert target.model.feature_layers == LAYERS
    load_head(HEADS_DIR / "default-medusa", target.model, torch.float32, torch.device("cpu"))
    assert target.model.feature_layers == () and target.model.feature_width == target.config.hidden_size
