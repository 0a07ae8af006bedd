"""Drafts with another tokenizer (worker/speculative/vocab_bridge.py, cross_draft.py).

The real pair: SmolLM2-135M-Instruct (49k byte-level BPE vocabulary) as the target and the
embedded 8k-vocabulary code draft, whose tokenizer differs (71% of its tokens are shared).
Greedy and seeded output with TLI and with SLEM equal plain output, batched with chunked
prefill and preemption. A tiny pair with crafted tokenizers (a 4-token target vocabulary and a
draft vocabulary that permutes three of them and adds one the target lacks) drives the error
paths fast; tests/engine/test_spec_distribution.py's chi-square cases use it too.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from draftwise.worker import default_model_path
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.cross_draft import CROSS_POOL_SCALE, CrossVocabProposer
from draftwise.worker.speculative.vocab_bridge import build_bridge, token_surfaces
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.engine.test_spec_exactness import run_together
from tests.model.smollm2 import require_smollm2

REPO = Path(__file__).resolve().parents[2]


def save_char_tokenizer(folder: Path, pieces: list[str]) -> None:
    """A tokenizer whose tokens are single characters, ``pieces[i]`` being id i."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))


TARGET_PIECES = ["a", "b", "c", "d"]
DRAFT_PIECES = ["d", "a", "e", "b"]  # "a", "b", "d" shared under other ids; "c" only the target's; "e" only the draft's


def make_cross_pair(root: Path, target: Path, draft: Path, draft_context: int | None = None) -> tuple[Path, Path]:
    """Copies of two tiny checkpoints with the crafted tokenizers: ``root/target``, ``root/draft``
    (the draft's context cut to ``draft_context`` when given)."""
    shutil.copytree(target, root / "target")
    shutil.copytree(draft, root / "draft")
    save_char_tokenizer(root / "target", TARGET_PIECES)
    save_char_tokenizer(root / "draft", DRAFT_PIECES)
    if draft_context is not None:
        cfg_path = root / "draft" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["max_position_embeddings"] = draft_context
        cfg_path.write_text(json.dumps(cfg))
    return root / "target", root / "draft"


# ---------------------------------------------------------------- the bridge, on real tokenizers


@pytest.fixture(scope="module")
def real_tokenizers():
    return load_tokenizer(require_smollm2()), load_tokenizer(default_model_path("draft"))


def test_the_bridge_between_smollm2_and_the_embedded_draft(real_tokenizers):
    target, draft = real_tokenizers
    bridge = build_bridge(draft, target, 8192, 49152)
    assert bridge is not None and bridge.mode == "tli"
    assert bridge.shared == 5806 and round(bridge.overlap, 4) == 0.7087  # what the worker logs at load
    ts, ds = token_surfaces(target), token_surfaces(draft)
    for t, d in bridge.to_draft.items():  # one to one, same bytes
        assert ts[t] == ds[d] and int(bridge.to_target[d]) == t
    assert len(set(bridge.to_draft.values())) == bridge.shared
    # every target token's translation stands for its bytes (byte-level BPE covers every byte)
    for t in random.Random(0).sample(range(len(ts)), 3000):
        assert b"".join(ds[d] or b"" for d in bridge.translate(t)) == (ts[t] or b""), t
    text = (REPO / "worker" / "speculative" / "draft.py").read_text()[:3000] + " ünïcödé 東京"
    ids = target.hf.encode(text, add_special_tokens=False)
    as_text = bridge.translate_text(ids)
    assert as_text[0] == draft.hf.bos_token_id and draft.decode(as_text) == text  # the draft's own encoding
    per_token = [d for t in ids for d in bridge.translate(t)]
    assert draft.decode(per_token) == text
    written = draft.hf.encode(text, add_special_tokens=False)
    assert bridge.retokenize(written, complete=True) == ids  # SLEM: the draft's text, in target tokens
    assert bridge.retokenize(written, complete=False) == ids[:-1]
    assert build_bridge(draft, load_tokenizer(default_model_path("target")), 8192, 8192) is None  # same tokenizer
    assert build_bridge(draft, target, 8192, 49152, "slem").mode == "slem"


def test_the_bridge_chooses_slem_below_half_and_refuses_tli_without_shared_tokens(tmp_path):
    for name, pieces in (("t", ["a", "b", "c", "d"]), ("d1", ["a", "x", "y", "z"]), ("d2", ["w", "x", "y", "z"])):
        save_char_tokenizer(tmp_path / name, pieces)
    target = load_tokenizer(tmp_path / "t")
    low = build_bridge(load_tokenizer(tmp_path / "d1"), target, 4, 4)
    assert low is not None and low.mode == "slem" and low.shared == 1 and low.overlap == 0.25
    assert build_bridge(load_tokenizer(tmp_path / "d1"), target, 4, 4, "tli").mode == "tli"
    with pytest.raises(ValueError, match="share no token"):
        build_bridge(load_tokenizer(tmp_path / "d2"), target, 4, 4, "tli")
    with pytest.raises(ValueError, match="speculative_vocab_mapping must be"):
        build_bridge(load_tokenizer(tmp_path / "d1"), target, 4, 4, "words")


# ---------------------------------------------------------------- exactness on the real pair


def _workload(tok) -> list[tuple[str, list[int], SamplingParams, int]]:
    """Slices of this repository's code as prompts (some long enough to be prefilled in chunks),
    greedy and seeded sampled requests, arriving over the first steps."""
    rng = random.Random(5)
    code = tok.hf.encode((REPO / "worker" / "core" / "scheduler.py").read_text(), add_special_tokens=False)
    out = []
    for i in range(10):
        n = rng.choice([3, 20, 60, 150])
        start = rng.randrange(len(code) - n)
        if i % 3 == 2:
            params = SamplingParams(temperature=0.8, seed=100 + i, max_tokens=rng.randint(8, 24), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(8, 24), ignore_eos=True)
        out.append((f"r{i}", code[start : start + n], params, rng.randint(0, 12)))
    return out


def _engine(model: Path, **spec) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            max_model_len=256,
            block_size=16,
            max_num_batched_tokens=48,  # prompts are prefilled in chunks
            max_num_seqs=6,
            num_kv_blocks=20,  # 320 tokens: forces preemption
            **spec,
        )
    )


@pytest.fixture(scope="module")
def real_workload(real_tokenizers):
    model = require_smollm2()
    reqs = _workload(real_tokenizers[0])
    return model, reqs, run_together(reqs, _engine(model))


@pytest.mark.parametrize("mapping", ["tli", "slem"])
def test_a_draft_with_another_tokenizer_is_exact_batched_chunked_and_preempted(real_workload, mapping):
    model, reqs, plain = real_workload
    engine = _engine(
        model,
        speculative_model="default",
        speculative_vocab_mapping=mapping,
        num_speculative_tokens=3,
        speculative_adaptive=False,
    )
    assert isinstance(engine.spec.proposer, CrossVocabProposer) and engine.spec.proposer.mode == mapping
    together = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0, "the workload did not force any preemption"
    mismatched = [rid for rid in plain if together[rid] != plain[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ from plain decoding, e.g. {mismatched[:3]}"
    totals = engine.spec_totals
    assert 0 < totals["accepted"] < totals["proposed"], totals  # both accepts and rejects happened
    engine.check_idle_invariants()


# ---------------------------------------------------------------- the tiny pair: error paths


@pytest.fixture(scope="module")
def tiny_cross(tmp_path_factory):
    from tests.engine.test_spec_distribution import _save_tiny

    root = tmp_path_factory.mktemp("tiny_cross")
    target = _save_tiny(root / "t0", seed=1)
    _save_tiny(root / "d0", seed=2, like=target, noise=0.5)
    return make_cross_pair(root / "pair", root / "t0", root / "d0", draft_context=40)


def _tiny_engine(folders, **kw) -> LLMEngine:
    target, draft = folders
    return LLMEngine(
        EngineConfig(
            model=str(target),
            speculative_model=str(draft),
            dtype="float32",
            skip_tokenizer_init=True,
            num_kv_blocks=64,
            block_size=4,
            num_speculative_tokens=3,
            speculative_adaptive=False,
            **kw,
        )
    )


def _drain(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        res = engine.step()
        engine.check_invariants()
        outs.update({o.request_id: o for o in res.finished})
    return outs


def test_a_draft_with_a_larger_vocabulary_than_the_targets(tmp_path_factory):
    """A 5-token draft for the 4-token target (SLEM: 2 of its 5 tokens shared; then TLI forced): exact."""
    from tests.engine.test_spec_distribution import _save_tiny

    root = tmp_path_factory.mktemp("bigger_draft")
    target = _save_tiny(root / "t0", seed=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tests.engine.test_spec_distribution.VOCAB", 5)
        _save_tiny(root / "d0", seed=3)
    shutil.copytree(root / "t0", root / "target")
    shutil.copytree(root / "d0", root / "draft")
    save_char_tokenizer(root / "target", TARGET_PIECES)
    save_char_tokenizer(root / "draft", ["x", "b", "y", "z", "a"])
    del target
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=str(root / "target"), dtype="float32", skip_tokenizer_init=True))
    plain.add_request("r", [1, 3, 0], params)
    want = _drain(plain)["r"].outputs[0].token_ids
    for mapping in ("auto", "tli"):
        engine = _tiny_engine((root / "target", root / "draft"), speculative_vocab_mapping=mapping)
        proposer = engine.spec.proposer
        assert isinstance(proposer, CrossVocabProposer) and proposer.mode == ("slem" if mapping == "auto" else "tli")
        engine.add_request("r", [1, 3, 0], params)
        got = _drain(engine)["r"].outputs[0]
        assert got.token_ids == want and got.num_spec_proposed > 0, mapping
        engine.check_idle_invariants()


def test_a_request_that_outgrows_the_drafts_context_stops_speculating(tiny_cross):
    """The draft's context is 40 tokens here: a 50-token answer is drafted for at first, then
    decoded plainly, and equals plain output."""
    target, _ = tiny_cross
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=str(target), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64))
    plain.add_request("r", [1, 3, 0], params)
    want = _drain(plain)["r"].outputs[0].token_ids
    engine = _tiny_engine(tiny_cross)
    engine.add_request("r", [1, 3, 0], params)
    got = _drain(engine)["r"].outputs[0]
    assert got.token_ids == want
    assert 0 < got.num_spec_proposed < 50
    engine.check_idle_invariants()


def test_a_failing_translation_ends_only_its_request_and_frees_its_blocks(tiny_cross):
    engine = _tiny_engine(tiny_cross)
    proposer = engine.spec.proposer
    assert isinstance(proposer, CrossVocabProposer) and proposer.mode == "tli"  # 3 of 4 draft tokens shared
    assert proposer.blocks.num_blocks == CROSS_POOL_SCALE * engine.blocks.num_blocks  # more draft tokens a text
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"ok{i}", [1, 3, i], params)
    engine.add_request("bad", [1, 3, 3], params)
    original = proposer._translated

    def translated(req, kv):
        if req.request_id == "bad" and len(req.output_token_ids) >= 2:
            raise IndexError("injected: this request's tokens cannot be translated")
        original(req, kv)

    proposer._translated = translated
    try:
        outs = _drain(engine)
    finally:
        del proposer._translated
    assert outs["bad"].outputs[0].finish_reason == "error" and "injected" in outs["bad"].error
    for i in range(3):
        alone = _tiny_engine(tiny_cross)
        alone.add_request("x", [1, 3, i], params)
        assert outs[f"ok{i}"].outputs[0].token_ids == _drain(alone)["x"].outputs[0].token_ids
    engine.check_idle_invariants()
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"speculative_vocab_mapping": "words", "speculative_model": "default"}, "speculative_vocab_mapping must be"),
        ({"speculative_vocab_mapping": "tli", "speculative_method": "ngram"}, "applies to a draft model"),
    ],
)
def test_bad_vocab_mapping_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_a_vocab_mapping_for_a_draft_that_shares_the_tokenizer_is_refused():
    with pytest.raises(ValueError, match="the draft shares the target's tokenizer"):
        LLMEngine(EngineConfig(speculative_model="default", speculative_vocab_mapping="slem", num_kv_blocks=16))


def test_a_larger_draft_vocabulary_without_tokenizers_is_refused(tmp_path):
    """Without tokenizers nothing says how the ids map: a draft with more ids than the target is refused at load."""
    from tests.engine.test_spec_distribution import _save_tiny

    _save_tiny(tmp_path / "target", seed=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tests.engine.test_spec_distribution.VOCAB", 5)
        _save_tiny(tmp_path / "draft", seed=3)
    with pytest.raises(ValueError, match="no tokenizer says how the two map"):
        _tiny_engine((tmp_path / "target", tmp_path / "draft"))
