"""The built wheel carries the default models, installs nothing but ``draftwise`` at the top
level, and ``draftwise generate`` runs from it in another directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ["pyproject.toml", "README.md", "LICENSE"]:
        shutil.copy(ROOT / name, src / name)
    for name in ["common", "worker", "kernels", "gateway", "proto"]:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (whl,) = out.glob("draftwise-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"draftwise"}, top
    for which in ["target", "draft"]:
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "README.md",
        ]:
            assert f"draftwise/worker/default_models/{which}/{f}" in names
    assert "draftwise/kernels/reference.py" in names and "draftwise/cli/__init__.py" in names
    for proto in ["generation", "generate_service", "worker_service"]:
        assert f"draftwise/v1/{proto}_pb2.py" in names and f"draftwise/v1/{proto}.proto" in names


def test_wheel_has_every_module(wheel):
    """Packages are listed by hand in pyproject.toml: a subpackage left out would be missing."""
    names = set(zipfile.ZipFile(wheel).namelist())
    mapping = {
        "common": "draftwise",
        "worker": "draftwise/worker",
        "kernels": "draftwise/kernels",
        "gateway": "draftwise/gateway",
        "proto/draftwise/v1": "draftwise/v1",
    }
    missing = []
    for folder, target in mapping.items():
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            rel = py.relative_to(ROOT / folder).as_posix()
            if f"{target}/{rel}" not in names:
                missing.append(f"{folder}/{rel}")
    assert not missing, f"not in the wheel: {missing}"


def test_generate_from_installed_wheel_elsewhere(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    # From the repository root too: no folder there shadows the installed package.
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import draftwise.worker.engine.llm_engine as e, draftwise.gateway.main; print(e.__file__)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.startswith(str(target)), res.stdout + res.stderr
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    code = "import draftwise.worker as w, sys; print(w.__file__); from draftwise.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run(
        [sys.executable, "-c", code, "generate", "def fibonacci(n):", "--max-tokens", "24"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    first, rest = res.stdout.split("\n", 1)
    assert first.startswith(str(target)), first  # ran from the installed copy
    assert rest.startswith("def fibonacci(n):") and len(rest) > len("def fibonacci(n):") + 10


def test_wheel_metadata_license_and_optional_triton(wheel):
    """SPDX license with its file; triton only in the gpu and test extras (a CPU install skips it)."""
    z = zipfile.ZipFile(wheel)
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    assert "Project-URL: Repository, https://" in text and "Project-URL: Documentation, https://" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist: triton")]
    assert requires and all("extra ==" in line for line in requires), requires
