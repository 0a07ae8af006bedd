"""The wide prompt families for the draft heads (scripts/head_prompts_wide.py) keep the
held-out evaluation (bench/head_eval_prompts.py) held out: no prompt equals, contains or is
contained in an evaluation prompt, none names an evaluation prompt's subject, and the set is
reproducible, distinct and covers the evaluation's three kinds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # (the script puts bench/ on the path for the evaluation prompts)
import head_prompts_wide as wide  # noqa: E402
from head_eval_prompts import ALL as EVAL  # noqa: E402

HELD_OUT = [p for _, p in EVAL]


def test_no_wide_prompt_touches_an_evaluation_prompt_or_its_subject() -> None:
    pairs = wide.wide_prompts(4800, 0)
    assert len(pairs) == 4800
    assert len({p for _, p in pairs}) == len(pairs)  # distinct
    assert [p for _, p in pairs if any(e in p or p in e for e in HELD_OUT)] == []
    assert [p for _, p in pairs if any(w in p.lower() for w in wide.EVAL_SUBJECTS)] == []
    assert pairs == wide.wide_prompts(4800, 0)  # reproducible
    assert {k for k, _ in pairs} == {k for k, _ in EVAL} == {"chat", "code", "reasoning"}


def test_every_evaluation_prompt_names_one_of_the_excluded_subjects() -> None:
    # the subject filter is what keeps near-rewordings of the evaluation out: each evaluation
    # prompt must itself be caught by it, or a rewording of that prompt could slip through
    assert [p for p in HELD_OUT if not any(w in p.lower() for w in wide.EVAL_SUBJECTS)] == []


def test_a_subject_of_the_evaluation_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wide, "SUBJECTS", {"only": ("pancakes", "soup")})
    pairs = wide.wide_prompts(40, 0)
    assert pairs and all("pancake" not in p.lower() for _, p in pairs)


def test_wide_prompts_refuse_more_than_the_families_can_make() -> None:
    with pytest.raises(ValueError, match="more than the families can make"):
        wide.wide_prompts(1_000_000, 0)
