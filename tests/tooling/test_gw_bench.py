"""bench/bench_gateway.py: its --rounds flag and the table it writes (medians over
alternating rounds, per-round throughput kept)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_gateway as bg  # noqa: E402


def _run(tps: float, p50: float, p99: float, **cpu: float) -> dict:
    return {"output_tokens": 128, "seconds": 1.0, "tokens_per_s": tps, "itl_p50_ms": p50, "itl_p99_ms": p99, **cpu}


def test_rounds_must_be_positive() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_gateway.py"), "--rounds", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--rounds must be >= 1, got 0" in r.stderr


def test_medians_and_render() -> None:
    cpu = {"gateway_cpu_us_per_token": 90.0, "worker_cpu_us_per_token": 700.0}
    runs = [_run(100, 5, 9, **cpu), _run(300, 7, 30, **cpu), _run(200, 6, 10, **cpu)]
    med = bg.median_run(runs)
    assert med["tokens_per_s"] == 200 and med["itl_p99_ms"] == 10 and med["gateway_cpu_us_per_token"] == 90
    results = {
        "machine": "test machine",
        "threads": 1,
        "new_tokens": 128,
        "rounds": 3,
        "date": "2026-12-01",
        "levels": {
            64: {
                "engine": _run(1000, 40, 100, engine_cpu_us_per_token=600.0),
                "gateway": _run(900, 45, 120, client_cpu_us_per_token=50.0, **cpu),
                "kept_per_round": [0.85, 0.9, 0.95],
                "kept": 0.9,
            }
        },
    }
    text = bg.render(results)
    assert "Command: `python bench/bench_gateway.py` — 2026-12-01, test machine" in text
    assert "alternate 3 times per level" in text
    assert "| 64 | 1000 | 900 | 90.0% | 40.00 / 100.00 | 45.00 / 120.00 | +20.00 |" in text
    assert "64 streams: 85% / 90% / 95%" in text
    assert "64 streams: engine alone 600, through the gateway: worker 700, gateway 90, client 50" in text
