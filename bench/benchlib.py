"""Shared pieces of the benchmarks: held-out prompts, machine facts, and writing a section
of docs/benchmarks.md between markers so that each benchmark owns its own section."""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import json
import os
import platform
import random
import re
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"


def heldout_texts(min_chars: int = 2000) -> list[str]:
    """Texts of the standard-library files the default models never trained on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in (ROOT / "docs" / "heldout_files.txt").read_text().split():
        p = root / name
        if p.is_file() and p.stat().st_size >= min_chars:
            out.append(p.read_text(encoding="utf-8", errors="replace"))
    return out


def heldout_prompts(tokenizer, n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """``n`` prompts of token ids, lengths uniform in ``lengths``, cut from held-out files."""
    rng = random.Random(seed)
    encoded = [tokenizer.encode(t) for t in heldout_texts()]
    encoded = [e for e in encoded if len(e) > lengths[1] + 1]
    out = []
    for _ in range(n):
        ids = rng.choice(encoded)
        length = rng.randint(*lengths)
        start = rng.randrange(1, len(ids) - length)
        out.append([ids[0]] + ids[start : start + length - 1])  # BOS + a window of code
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def save_results(name: str, results: dict) -> Path:
    """Write ``results`` to bench/results/``name``.json (the source of the docs' tables and plots)."""
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return out


def write_section(name: str, body: str, doc: Path | None = None) -> None:
    """Replace (or append) the section ``name`` of docs/benchmarks.md (or of ``doc``)."""
    doc = doc or DOC
    doc.parent.mkdir(exist_ok=True)
    text = (
        doc.read_text()
        if doc.exists()
        else "# Benchmarks\n\nEvery figure is a ratio against a reference measured in the same run on the same machine.\n"
    )
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


MODEL_HELP = "model alias (e.g. smollm2-135m-instruct), checkpoint folder or .gguf file; default: the embedded target"


def add_model_argument(ap) -> None:
    """``--model``: the target every engine of the benchmark serves (None: the embedded default)."""
    ap.add_argument("--model", default=None, help=MODEL_HELP)


def is_default_model(model: str | Path | None) -> bool:
    return model is None or str(model) == "default"


def model_slug(model: str | Path | None) -> str:
    """A file-name-safe name of ``model``: ``default``, the alias, or the checkpoint's name."""
    if is_default_model(model):
        return "default"
    from draftwise.worker.paths import MODEL_ALIASES

    name = str(model).lower() if str(model).lower() in MODEL_ALIASES else Path(str(model).rstrip("/")).stem
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def for_model(name: str, model: str | Path | None, sep: str = "-") -> str:
    """``name`` for the embedded target (sections and result files keep their names), else
    ``name`` + ``sep`` + the model's slug, so that another model's run never replaces them."""
    return name if is_default_model(model) else f"{name}{sep}{model_slug(model)}"


def model_label(model: str | Path | None) -> str:
    """How section titles name the target."""
    return "default target" if is_default_model(model) else f"`{model_slug(model)}`"


def hf_causal_lm(model: str | Path | None):
    """transformers' model of the same checkpoint (float32, eval): a folder, or a GGUF file
    (dequantized by transformers through the ``gguf`` package)."""
    from transformers import AutoModelForCausalLM

    from draftwise.worker.paths import resolve_model

    path = resolve_model(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
