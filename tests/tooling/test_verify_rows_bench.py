"""bench/bench_verify_rows.py runs end to end on the embedded target: real forward passes over
each row count, a table with one line per count, the one-row pass as the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_verify_rows_bench_times_every_row_count() -> None:
    args = ["--rows", "1,3,9", "--steps", "5", "--rounds", "1", "--context", "40", "--threads", "1", "--print-only"]
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_verify_rows.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    ms = json.loads(res.stdout.strip().splitlines()[-1])
    assert list(ms) == ["1", "3", "9"] and all(v > 0 for v in ms.values()), ms
    assert "| 9 |" in res.stdout and "| 1 |" in res.stdout and "1.00 |" in res.stdout
