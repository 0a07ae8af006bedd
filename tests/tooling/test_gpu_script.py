"""tests/gpu/check_gpu.py keeps working without a GPU: its --dry-run mode runs every
section on CPU with tiny shapes (Triton kernels under the interpreter, graph replay stood
in for by the graph runner's eager path) and prints the table last."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[1] / "gpu" / "check_gpu.py"


@pytest.fixture(scope="module")
def check_gpu() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_gpu"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_passes_and_prints_the_table_last(tmp_path):
    out = tmp_path / "rows.json"
    # a process of its own: the script configures logging, as a user's run would
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    printed = res.stdout.rstrip().splitlines()
    assert printed[-1].endswith("rows, 0 failed")
    assert "(dry run)" in next(line for line in printed if line.startswith("draftwise GPU check"))
    rows = json.loads(out.read_text())["rows"]
    checks = [r["check"] for r in rows]
    for want in (
        "attention decode float32 bs16",
        "attention prefill/verify float32 bs32",
        "write_kv_cache float32 bs16",
        "rms_norm+residual float32",
        "rejection_accept float32 (draft q, n-gram)",
        "replay == eager logits, 15 shapes",  # 3 decode shapes, 12 flat ones (Q = 4)
        "replay == eager spec off float32",
        "replay == eager spec draft k=3 float32",
        "replay == eager spec ngram k=4 float32",
        "device copy bandwidth",
        "TP=2 greedy equals TP=1",  # on CPU with gloo in the dry run
    ):
        assert want in checks, want
    assert any(c.startswith("decode step batch 1 ") for c in checks)
    assert any(c.startswith("end to end") and "n-gram" in c for c in checks)
    assert all(r["ok"] is not False for r in rows)
    llm_rows = [r for r in rows if r["check"].startswith("replay == eager spec")]
    assert all(" 0 replays" not in r["result"] and not r["result"].startswith("0/") for r in llm_rows)
    shapes = next(r for r in rows if r["check"].startswith("replay == eager logits"))
    assert "argmax" in shapes["result"] and "0 not replayed" in shapes["result"]


def test_failures_become_rows_not_crashes(check_gpu):
    rows: list = []

    def broken(ctx, rows):
        raise ImportError("no module named draftwise.kernels.triton_missing")

    check_gpu._section(rows, "kernels", broken, check_gpu.make_ctx(True))
    assert len(rows) == 1 and rows[0].ok is False and "ImportError" in rows[0].result
    table = check_gpu.format_table([*rows, check_gpu.Row("timings", "x", "1 GB/s")], "header")
    lines = table.splitlines()
    assert lines[0] == "header" and lines[-1] == "2 rows, 1 failed"
    assert lines[3].startswith("FAIL") and lines[4].startswith("info")
    goals = [check_gpu.Row("timings", "y", "3x", ">= 2x", goal_met=v) for v in (True, False)]
    table = check_gpu.format_table(goals, "header").splitlines()
    assert table[3].startswith("met") and table[4].startswith("MISS")
    assert table[-1] == "2 rows, 0 failed, 1 goals missed"  # a missed goal is no failure
