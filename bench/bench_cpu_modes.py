"""The CPU weight modes against each other in one run: float32, ``--quantization fp16``, ``int8``
and ``int4`` on the same model, batch-1 decode in-process (``LLM.generate``, as
``bench_cpu.py``'s decode) and the model's weight products alone for 1 and 4 rows (every
projection and the LM head back to back, weights streamed from memory as in a step), each as a
ratio against float32 measured in the same run. Modes alternate over ``--rounds`` rounds; each
keeps its best. (bench_cpu.py puts them beside llama.cpp when its binaries are at hand.)

    python bench/bench_cpu_modes.py --model smollm2-135m-instruct [--rounds 2] [--threads 2]

Writes docs/benchmarks.md (section ``cpu-modes`` + the model) and bench/results/cpu_modes*.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import in_process_decode, read_bandwidth  # noqa: E402
from benchlib import add_model_argument, for_model, machine, model_label, save_results, write_section  # noqa: E402

from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402

MODES = {"float32": None, "fp16": "fp16", "int8": "int8", "int4": "int4"}


def products_ms(path: Path, quantization: str | None, rows: int, repeats: int = 20) -> float:
    """Median ms of every product of the model, back to back, for ``rows`` rows."""
    linears = load_model(path, quantization=quantization).model.linears()
    xs = [torch.randn(rows, m.in_features) for m in linears]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for m, x in zip(linears, xs, strict=True):
            m.product(x)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[repeats // 5 :])


def render(r: dict) -> str:
    base = r["modes"]["float32"]
    lines = [
        f"## CPU weight modes against float32 ({model_label(r['model'])}, batch 1)",
        "",
        f"`{r['command']}` — {r['machine']}, {r['date']}; read bandwidth {r['read_gb_s']:.1f} GB/s.",
        "",
        "| mode | MB a step | decode tokens/s | x float32 | roofline fraction | products, 1 row (ms) | x float32 "
        "| products, 4 rows (ms) | x float32 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, d in r["modes"].items():
        roof = r["read_gb_s"] * 1e3 / d["streamed_mb"]
        lines.append(
            f"| {mode} | {d['streamed_mb']:.0f} | {d['tokens_per_s']:.1f} | {d['tokens_per_s'] / base['tokens_per_s']:.2f} "
            f"| {d['tokens_per_s'] / roof:.2f} | {d['products_1_ms']:.2f} | {base['products_1_ms'] / d['products_1_ms']:.2f} "
            f"| {d['products_4_ms']:.2f} | {base['products_4_ms'] / d['products_4_ms']:.2f} |"
        )
    lines += [
        "",
        "x float32: speed against float32's (higher is faster). Exactness per mode: docs/models.md, "
        '"Lower-precision weights on CPU".',
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(ap)
    ap.set_defaults(model="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--print-only", action="store_true", help="print the table; write neither docs nor results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for mode, quant in MODES.items():
            d = in_process_decode(path, quant, args.threads)
            d["products_1_ms"] = products_ms(path, quant, 1)
            d["products_4_ms"] = products_ms(path, quant, 4)
            b = best.setdefault(mode, d)
            for key in ("tokens_per_s",):
                b[key] = max(b[key], d[key])
            for key in ("products_1_ms", "products_4_ms"):
                b[key] = min(b[key], d[key])
            print(mode, json.dumps({k: round(v, 2) for k, v in d.items()}), flush=True)
    r = {
        "command": "python bench/bench_cpu_modes.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "read_gb_s": read_bandwidth() / 1e9,
        "modes": best,
    }
    if not args.print_only:
        save_results(for_model("cpu_modes", args.model, "_"), r)
        write_section(for_model("cpu-modes", args.model), render(r))
    print(render(r))


if __name__ == "__main__":
    main()
