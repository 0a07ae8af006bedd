"""The ``draftwise`` command: errors are one clear line and exit 2."""

from __future__ import annotations

import argparse
import dataclasses
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


def test_generate_prints_what_the_engine_generates(capsys):
    """In-process generate is the engine: its greedy tokens, its stop set (the model's end of
    sequence), its incremental detokenizer; the text streamed after the prompt."""
    from draftwise.worker import LLM, SamplingParams

    prompt = "class Stack:"
    assert main(["generate", prompt, "--max-tokens", "40"]) == 0
    out = capsys.readouterr().out
    llm = LLM(max_num_seqs=1)
    (ref,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert out == prompt + ref.outputs[0].text + "\n"


def test_generate_with_a_server_refuses_engine_flags(capsys):
    assert main(["generate", "x", "--server", "127.0.0.1:1", "--max-num-seqs", "4", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device, --max-num-seqs: engine flags of an in-process run, not with --server\n", err


# --- the flag table: every parser's flags come from the config dataclasses


def _subparser(name: str) -> argparse.ArgumentParser:
    from draftwise.cli.main import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def _by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def _defaults(cls: type) -> dict[str, object]:
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
    }  # type: ignore[misc]


def _check_parser(parser: argparse.ArgumentParser, cls: type, flags, missing: set[str], defaults: dict) -> None:
    """Every field of ``cls`` but ``missing`` is a flag of ``parser`` (dest = the field, its
    option the table's) whose default is the field's (or ``defaults``'s) and whose help is the
    field's doc."""
    actions = _by_dest(parser)
    table = {f.name: f for f in flags}
    for name, default in _defaults(cls).items():
        if name in missing:  # no flag of the table (another may set it: serve's --log-format is the gateway's)
            continue
        action = actions.get(name)
        assert action is not None, f"{cls.__name__}.{name} has no flag in {parser.prog}"
        assert table[name].option in action.option_strings
        want = defaults.get(name, default)
        assert action.default == (list(want) if isinstance(want, tuple) else want), (name, action.default, want)
        assert (action.help or "").startswith(table[name].help), (name, action.help)


def test_every_engine_config_field_is_a_flag_with_its_default_and_doc():
    from draftwise.cli.engine_flags import ENGINE_INTERNAL, GENERATE_DEFAULTS, GENERATE_SKIP, engine_flags
    from draftwise.worker.core.config import EngineConfig
    from draftwise.worker.serving.server import build_parser as worker_parser

    assert all(why for why in ENGINE_INTERNAL.values()) and all(why for why in GENERATE_SKIP.values())
    flags = engine_flags()
    assert {f.name for f in flags} | set(ENGINE_INTERNAL) == {f.name for f in dataclasses.fields(EngineConfig)}
    _check_parser(_subparser("serve"), EngineConfig, flags, set(ENGINE_INTERNAL), {})
    _check_parser(
        _subparser("generate"), EngineConfig, flags, set(ENGINE_INTERNAL) | set(GENERATE_SKIP), GENERATE_DEFAULTS
    )
    # the worker's own parser: every field, with the dataclass's default (its help is its own)
    worker = _by_dest(worker_parser())
    for f in dataclasses.fields(EngineConfig):
        assert f.name in worker and worker[f.name].default == f.default, f.name
    assert {name for name in GENERATE_DEFAULTS} == {"max_num_seqs"}  # the one deliberate difference
    by_name = {f.name: f for f in flags}
    assert by_name["max_num_seqs"].help == "requests in one step"  # EngineConfig's comment
    assert by_name["enforce_eager"].is_switch and by_name["max_model_len"].convert is int


def test_every_gateway_and_serve_config_field_is_a_flag_with_its_default_and_doc():
    from draftwise.cli.serve import SERVE_INTERNAL, serve_flags
    from draftwise.gateway.config import GatewayConfig
    from draftwise.gateway.launcher import ServeConfig
    from draftwise.gateway.main import GATEWAY_INTERNAL, build_parser, gateway_flags

    flags = gateway_flags()
    assert {f.name for f in flags} | set(GATEWAY_INTERNAL) == {f.name for f in dataclasses.fields(GatewayConfig)}
    _check_parser(build_parser(), GatewayConfig, flags, set(GATEWAY_INTERNAL), {})
    serve = _subparser("serve")
    _check_parser(serve, GatewayConfig, flags, set(GATEWAY_INTERNAL) | {"workers"}, {})
    _check_parser(serve, ServeConfig, serve_flags(), set(SERVE_INTERNAL), {})
    assert all(why for why in (*GATEWAY_INTERNAL.values(), *SERVE_INTERNAL.values()))
    opts = {f.name: f.option for f in flags}
    assert opts["workers"] == "--worker" and opts["shutdown_grace_s"] == "--shutdown-grace"
    assert {f.name: f.option for f in serve_flags()}["num_workers"] == "--workers"


def test_serve_passes_its_engine_flags_to_the_workers_exactly():
    """What serve gives each worker reads back, in the worker's parser, as the EngineConfig
    serve checked; defaults are not passed at all."""
    from draftwise.cli.engine_flags import engine_config
    from draftwise.cli.serve import worker_argv
    from draftwise.worker.core.config import EngineConfig
    from draftwise.worker.serving.server import build_parser as worker_parser

    given = ["--max-num-seqs=4", "--no-enable-chunked-prefill", "--max-num-batched-tokens=4096"]
    given += ["--speculative-method=ngram", "--no-speculative-adaptive", "--prompt-lookup-max=3", "--model-name=x"]
    args = _subparser("serve").parse_args(given)
    argv = worker_argv(args)
    assert argv[-2:] == ["--model-name", "x"] and "--device" not in argv and "--enforce-eager" not in argv
    sent = worker_parser().parse_args(argv)
    config = engine_config(args)
    assert EngineConfig(**{f.name: getattr(sent, f.name) for f in dataclasses.fields(EngineConfig)}) == config
    assert (config.max_num_seqs, config.enable_chunked_prefill, config.speculative_adaptive) == (4, False, False)
    assert worker_argv(_subparser("serve").parse_args([])) == []


def test_serve_passes_no_enable_prefix_caching_to_its_workers():
    """Prefix caching is on by default (nothing passed); --no-enable-prefix-caching reaches every
    worker's EngineConfig (the end-to-end run: tests/integration/test_prefix_cache_serving.py)."""
    from draftwise.cli.engine_flags import engine_config
    from draftwise.cli.serve import worker_argv
    from draftwise.worker.serving.server import build_parser as worker_parser

    args = _subparser("serve").parse_args(["--no-enable-prefix-caching"])
    argv = worker_argv(args)
    assert argv == ["--no-enable-prefix-caching"]
    assert worker_parser().parse_args(argv).enable_prefix_caching is False
    assert engine_config(args).enable_prefix_caching is False
    assert worker_parser().parse_args([]).enable_prefix_caching is True


@dataclasses.dataclass(frozen=True)
class _Documented:
    size: int = 3  # how many
    name: str | None = None
    """who it is; None: nobody"""
    ratio: float = 0.5  # a share of size_limit
    on: bool = True  # a switch
    size_limit: int | None = None  # at most this many
    tags: tuple[str, ...] = ()  # repeatable


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    size: int = 3


def test_flag_table_reads_both_doc_styles_and_refuses_a_field_without_one():
    from draftwise.flagtable import add_flags, as_argv, changed, config_values, field_docs, table

    assert field_docs(_Documented) == {
        "size": "how many",
        "name": "who it is; None: nobody",
        "ratio": "a share of size_limit",
        "on": "a switch",
        "size_limit": "at most this many",
        "tags": "repeatable",
    }
    flags = {f.name: f for f in table(_Documented)}
    assert flags["name"].help == "who it is; unset: nobody"
    assert flags["ratio"].help == "a share of --size-limit" and flags["ratio"].convert is float
    assert flags["tags"].repeatable and flags["on"].is_switch
    p = argparse.ArgumentParser()
    add_flags(p, tuple(flags.values()))
    args = p.parse_args(["--size=5", "--no-on", "--tags=a", "--tags=b"])
    values = config_values(args, tuple(flags.values()))
    assert _Documented(**values) == _Documented(size=5, on=False, tags=("a", "b"))
    given = changed(values, tuple(flags.values()))
    assert as_argv(given, tuple(flags.values())) == ["--size", "5", "--no-on", "--tags", "a", "--tags", "b"]
    with pytest.raises(ValueError, match="_Undocumented.size has no doc"):
        table(_Undocumented)
    with pytest.raises(ValueError, match="has no field nope"):
        table(_Documented, internal={"nope": "why"})
