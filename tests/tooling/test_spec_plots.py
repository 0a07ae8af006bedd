"""bench/bench_spec.py draws its plots (docs/img/) from the results it saved: one point per
concurrency level and per fixed k, read back from the image's pixels being non-blank and
from the series the plot was given."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_spec as bs  # noqa: E402


def _row(k: int, mean: float) -> dict:
    return {"tokens_per_s": 100.0 + k, "speedup_vs_plain": 1.0, "acceptance_rate": 0.5, "mean_accepted_length": mean}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_fixed_k_points_are_sorted_by_k_and_skip_adaptive() -> None:
    rows = {"fixed k=3": _row(3, 2.5), "adaptive (default: k <= 5)": _row(0, 9.0), "fixed k=1": _row(1, 1.7)}
    assert bs._fixed_k_points(rows) == ([1, 3], [1.7, 2.5])


def test_plots_from_results(tmp_path: Path) -> None:
    results = {
        "date": "2026-12-01",
        "machine": "test machine",
        "greedy": {"spec": {f"fixed k={k}": _row(k, 1 + 0.6 * k) for k in (1, 2, 3)}},
        "ngram": {"prompt_tokens": 10, "fixed k=1": _row(1, 1.9), "fixed k=5": _row(5, 3.5)},
        "concurrency": [
            {"concurrency": c, "plain_tokens_per_s": 100.0 * c, "spec_tokens_per_s": 110.0 * c, "date": "2026-12-01"}
            for c in (1, 4, 16)
        ],
    }
    written = bs.plot(results, tmp_path / "img")
    assert [p.name for p in written] == ["spec_concurrency.png", "spec_accepted_length.png"]
    for p in written:
        w, h = _png_size(p)
        assert w >= 400 and h >= 300
        assert p.stat().st_size > 10_000  # axes, lines and labels, not an empty canvas


def test_no_plot_without_data(tmp_path: Path) -> None:
    assert bs.plot({"date": "x"}, tmp_path) == []


def test_the_committed_results_plot(tmp_path: Path) -> None:
    """The results file the docs' plots come from still has what the plots need."""
    results = json.loads((ROOT / "bench" / "results" / "spec.json").read_text())
    assert len(bs.plot(results, tmp_path)) == 2
