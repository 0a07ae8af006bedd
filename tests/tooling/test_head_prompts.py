"""The draft heads' training prompts (scripts/head_prompts.py) never reach the held-out
evaluation prompts (bench/head_eval_prompts.py): no training prompt equals, contains or is
contained in an evaluation prompt, in any family, and the sets are reproducible."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
spec = importlib.util.spec_from_file_location("head_prompts", ROOT / "scripts" / "head_prompts.py")
assert spec is not None and spec.loader is not None
head_prompts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(head_prompts)

from head_eval_prompts import ALL as EVAL  # noqa: E402

HELD_OUT = [p for _, p in EVAL]


def _overlaps(prompt: str) -> list[str]:
    return [e for e in HELD_OUT if e in prompt or prompt in e]


@pytest.mark.parametrize("make", ["training_prompts", "broad_prompts"])
def test_no_training_prompt_is_an_evaluation_prompt(make: str) -> None:
    pairs = getattr(head_prompts, make)(1500, 0)
    assert len(pairs) > 1000
    assert len({p for _, p in pairs}) == len(pairs)  # distinct
    assert [p for _, p in pairs if _overlaps(p)] == []
    assert pairs == getattr(head_prompts, make)(1500, 0)  # reproducible


def test_broad_prompts_cover_the_three_kinds_of_the_evaluation() -> None:
    kinds = {k for k, _ in head_prompts.broad_prompts(600, 0)}
    assert kinds == {"chat", "code", "reasoning"} == {k for k, _ in EVAL}


def test_broad_prompts_refuse_more_than_the_families_can_make() -> None:
    with pytest.raises(ValueError, match="more than the chat or code families"):
        head_prompts.broad_prompts(100_000, 0)


def test_the_filter_drops_a_prompt_that_contains_an_evaluation_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    # a family that would produce an evaluation prompt verbatim loses it
    monkeypatch.setattr(head_prompts, "CODE_QUESTIONS", (*head_prompts.CODE_QUESTIONS, HELD_OUT[9]))
    pairs = head_prompts.broad_prompts(600, 0)
    assert all(p != HELD_OUT[9] for _, p in pairs)


def test_teacher_forced_answers_hold_no_evaluation_prompt() -> None:
    triples = head_prompts.text_answers(0)
    assert len(triples) > 200
    assert [p for _, p, a in triples if _overlaps(p) or any(e in a for e in HELD_OUT)] == []
