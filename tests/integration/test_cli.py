"""The ``draftwise`` command: errors are one clear line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_generate_over_the_context_is_one_line_before_any_output():
    """Run as a user runs it: the real command, its stdout, stderr and exit status."""
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "generate", "x " * 3000, "--max-tokens", "10"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and res.stdout == "", res.stdout[:200]
    assert res.stderr == (
        "error: the prompt is 3002 tokens and --max-tokens is 10: together more than the model's context of 2048 "
        "tokens (shorten the prompt or lower --max-tokens)\n"
    ), res.stderr[-2000:]


def test_generate_bad_dtype_is_one_line(capsys):
    assert main(["generate", "x", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dtype must be one of") and err.count("\n") == 1, err


def test_generate_bad_device_is_one_line(capsys):
    assert main(["generate", "x", "--device", "bogus"]) == 2
    assert capsys.readouterr().err == "error: --device must be cpu, cuda or cuda:N, got 'bogus'\n"


def test_generate_streams_default_model(capsys):
    assert main(["generate", "def fibonacci(n):", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):") and len(out) > len("def fibonacci(n):") + 5


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("draftwise ")


@pytest.mark.parametrize(
    ("given", "target"),
    [
        ("localhost", "localhost:50051"),
        ("127.0.0.1:50052", "127.0.0.1:50052"),
        ("[::1]", "[::1]:50051"),
        ("[::1]:7000", "[::1]:7000"),
        ("::1", "[::1]:50051"),
    ],
)
def test_server_without_a_port_dials_the_gateway_default(given, target):
    from draftwise.cli import server_address

    assert server_address(given) == target


@pytest.mark.parametrize("bad", ["host:http", "host:0", "host:70000"])
def test_a_bad_server_address_exits_2_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "x", "--server", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--server" in err and "Traceback" not in err


def test_a_missing_tls_ca_is_one_line_and_exit_2(tmp_path, capsys):
    code = main(["generate", "x", "--server", "127.0.0.1:1", "--tls-ca", str(tmp_path / "missing.pem")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --tls-ca") and "No such file" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
@pytest.mark.parametrize("value", ["99999", "-1", "http"])
def test_serve_refuses_a_port_out_of_range_before_starting_anything(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and "Traceback" not in err
