"""Every flag of ``draftwise worker``, ``gateway`` and ``serve`` reads ``DRAFTWISE_<FLAG>``; the
command line wins; a bad value names the variable (exit 2, no traceback); ``--help`` shows the
variables. Tested on the real parsers."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from draftwise.envflags import apply_env, env_actions, env_name
from draftwise.gateway.main import build_parser as gateway_parser
from draftwise.worker.serving.server import build_parser as worker_parser


def test_env_name() -> None:
    assert env_name("--worker-dns") == "DRAFTWISE_WORKER_DNS"
    assert env_name("--port") == "DRAFTWISE_PORT"


def test_value_from_env_and_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTWISE_PORT", "6000")
    monkeypatch.setenv("DRAFTWISE_FAILOVER_WAIT_S", "2.5")
    monkeypatch.setenv("DRAFTWISE_LOG_FORMAT", "json")
    args = gateway_parser().parse_args(["--worker=a:1"])
    assert (args.port, args.failover_wait_s, args.log_format) == (6000, 2.5, "json")
    args = gateway_parser().parse_args(["--worker=a:1", "--port=7000"])
    assert args.port == 7000
    monkeypatch.setenv("DRAFTWISE_PORT", "")  # empty: unset
    assert gateway_parser().parse_args([]).port == 50051


def test_repeatable_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTWISE_WORKER", "w0:50061, w1:50061 w2:50061")
    monkeypatch.setenv("DRAFTWISE_WORKER_DNS", "workers.ns.svc:50061")
    args = gateway_parser().parse_args([])
    assert args.workers == ["w0:50061", "w1:50061", "w2:50061"]
    assert args.worker_dns == [("workers.ns.svc", 50061)]
    args = gateway_parser().parse_args(["--worker=x:1", "--worker=y:2"])
    assert args.workers == ["x:1", "y:2"]  # the command line replaces the variable's list
    assert args.worker_dns == [("workers.ns.svc", 50061)]


def test_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_parser().parse_args([]).enforce_eager is False
    monkeypatch.setenv("DRAFTWISE_ENFORCE_EAGER", "true")
    monkeypatch.setenv("DRAFTWISE_INSECURE_INTERNAL", "1")
    monkeypatch.setenv("DRAFTWISE_SPECULATIVE_ADAPTIVE", "off")
    args = worker_parser().parse_args([])
    assert (args.enforce_eager, args.insecure_internal, args.speculative_adaptive) == (True, True, False)
    args = worker_parser().parse_args(["--no-enforce-eager", "--speculative-adaptive"])
    assert (args.enforce_eager, args.speculative_adaptive) == (False, True)


def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name, value, why in (
        ("DRAFTWISE_PORT", "abc", "not a port number: 'abc'"),
        ("DRAFTWISE_PORT", "70000", "70000 is not a port"),
        ("DRAFTWISE_MAX_IN_FLIGHT", "many", "invalid int value: 'many'"),
        ("DRAFTWISE_LOG_FORMAT", "xml", "invalid choice: 'xml'"),
        ("DRAFTWISE_WORKER_DNS", "workers", "not NAME:PORT: 'workers'"),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as e:
            gateway_parser().parse_args(["--worker=a:1"])
        assert e.value.code == 2
        assert f"error: environment variable {name}={value!r}: {why}" in capsys.readouterr().err
        monkeypatch.delenv(name)
    monkeypatch.setenv("DRAFTWISE_ENFORCE_EAGER", "maybe")
    with pytest.raises(SystemExit):
        worker_parser().parse_args([])
    assert "DRAFTWISE_ENFORCE_EAGER='maybe': not a switch value" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["worker", "gateway", "serve"])
def test_cli_bad_env_is_one_error_and_help_shows_variables(command: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "DRAFTWISE_PORT": "abc", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", command], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 2
    assert p.stderr.splitlines()[-1] == (
        f"draftwise {command}: error: environment variable DRAFTWISE_PORT='abc': not a port number: 'abc'"
    )
    assert "Traceback" not in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", command, "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0
    flat = " ".join(p.stdout.split())
    assert "[env: DRAFTWISE_PORT]" in flat and "[env: DRAFTWISE_LOG_LEVEL]" in flat
    assert "[env: DRAFTWISE_HELP]" not in flat


def _serve_parser() -> argparse.ArgumentParser:
    from draftwise.cli.main import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def test_every_flag_has_a_variable() -> None:
    for parser in (worker_parser(), gateway_parser(), _serve_parser()):
        names = env_actions(parser)
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        covered = {o for a in names.values() for o in a.option_strings}
        assert flags - covered == set(), flags - covered


def test_apply_env_with_explicit_mapping() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--limit", type=int, default=1, help="how many")
    p.add_argument("--verbose", action="store_true")
    apply_env(p, environ={"DRAFTWISE_LIMIT": "3", "DRAFTWISE_VERBOSE": "yes"})
    args = p.parse_args([])
    assert (args.limit, args.verbose) == (3, True)
    assert p.parse_args(["--limit=5"]).limit == 5
    assert "how many [env: DRAFTWISE_LIMIT]" in " ".join(p.format_help().split())


def test_serve_reads_the_environment() -> None:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "DRAFTWISE_WORKERS": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "serve"], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == "draftwise: error: --workers must be >= 1"
    p = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "serve", "--port=70000"],
        capture_output=True,
        text=True,
        env={**env, "DRAFTWISE_WORKERS": "1"},
        timeout=120,
    )
    assert p.returncode == 2 and "argument --port: 70000 is not a port" in p.stderr  # the flag, not the variable
