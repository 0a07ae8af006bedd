"""Every Python code block in README.md, docs/*.md and clients/*/README.md runs as written:
each in its own interpreter (from a temporary folder, so the installed package is what it
imports), against the integration tests' real gateway where it talks to a server (its
address ``127.0.0.1:50051`` is replaced by that gateway's). Docs cannot drift from the code.

Blocks fenced ```` ```py ```` are the exception, for a stated reason: they need a model with
a chat template or the OpenAI HTTP endpoint, which this gateway does not have, so the chat
and OpenAI tests run them against servers that do (tests/integration/test_chat.py,
test_openai.py); :func:`test_py_blocks_are_the_ones_run_elsewhere` keeps that list exact."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.procs import ROOT, child_env

SERVER_ADDRESSES = ("127.0.0.1:50051", "localhost:50051")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "clients").glob("*/README.md"))]
    out = []
    for f in files:
        text = f.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{f.relative_to(ROOT)}:{line}", m.group(1)))
    return out


BLOCKS = _blocks()


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 6, [name for name, _ in BLOCKS]


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_doc_snippet_runs(code: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if any(a in code for a in SERVER_ADDRESSES):
        address = request.getfixturevalue("gateway").address
        for a in SERVER_ADDRESSES:
            code = code.replace(a, address)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=child_env(PYTHONPATH=str(ROOT / "clients" / "python")),  # the torch-free client, as pip installs it
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the snippet printed nothing"


RUN_ELSEWHERE = {"docs/openai.md": 1, "docs/serving.md": 1, "clients/python/README.md": 1}
"""The ```py blocks, per file: the chat and OpenAI tests run exactly these."""


def test_py_blocks_are_the_ones_run_elsewhere():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "clients").glob("*/README.md"))]
    found = {}
    for f in files:
        n = len(re.findall(r"^```py\n", f.read_text(), re.M))
        if n:
            found[str(f.relative_to(ROOT))] = n
    assert found == RUN_ELSEWHERE
