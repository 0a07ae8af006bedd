"""A source checkout on ``sys.path`` never hides an installed package under a folder's name.

The checkout's folders are ``draftwise.*`` import names (``kernels/`` is ``draftwise.kernels``), but
``python -m``/``-c`` and pytest run from the checkout put it first on ``sys.path``, where ``kernels/``
hid Hugging Face's ``kernels`` package: transformers 5.25 imports it on every tokenizer load, and every
command run from the checkout failed ("cannot import name 'CUDAProperties' from 'kernels'").
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _run(code: str, tmp_path: Path, *pre: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("INSTALLED = True\n")
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *pre, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_an_installed_kernels_package_wins_over_the_checkout_folder(tmp_path):
    res = _run("import draftwise, kernels; print(kernels.__file__)", tmp_path)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == tmp_path / "site" / "kernels" / "__init__.py", res.stdout


def test_without_draftwise_the_checkout_folder_would_hide_it(tmp_path):
    """The case the guard is for: the same command without importing draftwise first."""
    res = _run("import kernels; print(kernels.__file__)", tmp_path)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == ROOT / "kernels" / "__init__.py", res.stdout


def test_the_checkout_stays_importable_behind_the_installed_packages(tmp_path):
    site = sysconfig.get_paths()["purelib"]
    code = (
        "import draftwise, os, sys, tests.conftest; e = [os.path.abspath(p or os.curdir) for p in sys.path]; "
        f"print(e.index({str(ROOT)!r}) > e.index({site!r}))"
    )
    res = _run(code, tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stdout + res.stderr


def test_this_test_process_has_the_checkout_behind_site_packages():
    """pytest itself (``--import-mode=append``, and ``python -m pytest`` putting the checkout first)."""
    site = sysconfig.get_paths()["purelib"]
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if str(ROOT) in entries:
        assert entries.index(str(ROOT)) > entries.index(site), sys.path
