"""bench/bench_cpu.py: the section it writes from its results (every ratio computed from the
two figures beside it), and the files it compares without llama.cpp (the model's own only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_cpu as bc  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cpu_smollm2-135m-instruct.json"


def test_the_committed_results_render_with_their_ratios() -> None:
    r = json.loads(RESULTS.read_text())
    text = bc.render(r)
    f32 = r["decode"]["float32"]["tokens_per_s"]
    theirs = r["llama_bench"]["F32"]
    row = next(line for line in text.splitlines() if line.startswith("| float32 | "))
    ratio = r["decode"]["float32"].get("ratio", f32 / theirs)  # interleaved rounds: the median of their ratios
    assert f"| {f32:.1f} | {theirs:.1f} | {ratio:.2f}x |" in row
    sv = r["served"]["fp16"]  # in turn with the in-process decode: the median of the rounds' ratios
    served = sv.get("ratio", sv["tokens_per_s"] / r["decode"]["fp16"]["tokens_per_s"])
    served_row = text.split("### Served over HTTP")[1].split("\n| fp16 | ")[1].splitlines()[0]
    assert f"| {served:.2f}x |" in served_row
    assert "goal <= 15 s" in text and "llama-server with 32 slots" in text


def test_the_products_table_and_the_int8_line() -> None:
    r = {
        "model": "m",
        "products_ms": {"1": {"a": 10.0, "b": 5.25}, "4": {"a": 20.0, "b": 6.0}},
        "int8_dynamic_accuracy": {"positions": 100, "max_abs_logit_diff": 3.5, "argmax_agreement": 0.4},
    }
    lines = bc.render(r).splitlines()
    assert "| rows | a | b |" in lines
    assert "| 1 | 10.0 | 5.2 |" in lines or "| 1 | 10.0 | 5.3 |" in lines
    assert any("argmax agreement 40.0%" in line for line in lines)


def test_without_llama_cpp_only_the_models_own_file_is_compared(tmp_path: Path) -> None:
    model = tmp_path / "Some-Model.Q4_1.gguf"
    model.write_bytes(b"GGUF")
    assert bc.gguf_files(model, None) == {"Q4_1": model}


def test_interleaved_rounds_take_turns_and_give_the_median_of_each_rounds_ratio() -> None:
    calls: list[str] = []
    ours = iter([2.0, 4.0, 3.0])
    theirs = iter([1.0, 4.0, 2.0])

    def a() -> float:
        calls.append("ours")
        return next(ours)

    def b() -> float:
        calls.append("llama")
        return next(theirs)

    got = bc.interleaved(a, b, rounds=3)
    assert calls == ["ours", "llama"] * 3
    assert got["tokens_per_s"] == 3.0 and got["llama_cpp"] == 2.0
    assert got["ratio"] == 1.5  # rounds' ratios 2, 1, 1.5: not 3 / 2 of the medians
    alone = bc.interleaved(lambda: 5.0, None, rounds=2)
    assert alone == {"tokens_per_s": 5.0, "rounds": [5.0, 5.0]}


def test_the_served_row_taken_in_turn_shows_the_rounds_ratios() -> None:
    sv = {
        "tokens_per_s": 90.0,
        "streamed_tokens_per_s": 80.0,
        "in_process_tokens_per_s": 100.0,
        "ratio": 0.93,  # the median of the rounds' ratios, not 90 / 100
        "streamed_ratio": 0.81,
        "ttft_256_s": 0.3,
    }
    text = bc.render({"model": "m", "served": {"fp16": sv}})
    assert "| fp16 | 90.0 | 100.0 | 0.93x | 80.0 | 0.81x | 0.300 |" in text.splitlines()
