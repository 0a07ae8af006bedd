"""ruff lint and format are part of the test suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is not installed (it is in the [test] extra)"
    return [exe]


def test_ruff_check():
    res = subprocess.run([*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format():
    res = subprocess.run([*_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_product_refers_to_nothing_outside_its_repository():
    """Docs, code and tests point at the repository's own docs, never at files beside the
    checkout. The markers are assembled from parts so that this file does not name them."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    markers = ("..", "/sha" + "red"), ("DES" + "IGN", ".md"), ("DES" + "IGN", " §")
    markers = tuple(a + b for a, b in markers)
    folders = ["worker", "gateway", "kernels", "common", "clients", "docs", "proto", "scripts", "bench", "tests"]
    files = [
        root / "README.md",
        *(
            f
            for d in folders
            for f in (root / d).rglob("*")
            if f.suffix in {".py", ".md", ".proto"} and "node_modules" not in f.parts
        ),
    ]
    offenders = [str(f.relative_to(root)) for f in files if any(m in f.read_text(errors="replace") for m in markers)]
    assert not offenders, offenders
