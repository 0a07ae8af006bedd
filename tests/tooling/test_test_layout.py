"""tests/unit holds only tests that load no model and start no process (they run in seconds
and anywhere); the others live in model/, engine/, integration/ or tooling/."""

from __future__ import annotations

import re
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1] / "unit"
LOADS_OR_STARTS = re.compile(
    r"\b(?:load_model|LLMEngine\(|LLM\(|from_pretrained|default_model_path|make_checkpoint|subprocess|Popen|"
    r"start_gateway|start_workers|multiprocessing)"
)


def test_unit_tests_load_no_model_and_start_no_process() -> None:
    found = {
        p.name: sorted(set(LOADS_OR_STARTS.findall(p.read_text())))
        for p in sorted(UNIT.glob("test_*.py"))
        if LOADS_OR_STARTS.search(p.read_text())
    }
    assert not found, found
    assert len(list(UNIT.glob("test_*.py"))) >= 15
