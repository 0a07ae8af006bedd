"""The ``draftwise`` command: errors are one clear line and exit 2."""

from __future__ import annotations

import pytest

from draftwise.cli import main


def test_generate_bad_model_folder(tmp_path, capsys):
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err


def test_generate_bad_max_tokens(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "x", "--max-tokens", "0"])
    assert e.value.code == 2 and "--max-tokens must be >= 1" in capsys.readouterr().err


def test_generate_streams_default_model(capsys):
    assert main(["generate", "def fibonacci(n):", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):") and len(out) > len("def fibonacci(n):") + 5
