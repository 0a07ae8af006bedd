"""Commands from vLLM's guides, parsed: ``draftwise serve MODEL`` (the positional model, and its
one-line conflict with ``--model``), ``--draft-model`` (``--speculative-model``'s synonym in every
engine-flag parser), ``--use-v2-block-manager`` (accepted, a notice, no value),
``--enable-chunked-prefill`` / ``--no-...``, the api_server's ports (``--port`` is HTTP), and the
checks that fail before any worker starts (a Hugging Face name with no local copy, a
``--max-model-len`` past the model's context). Nothing here starts a process or loads a model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from draftwise.cli.engine_flags import context_problem, engine_config, path_problem
from draftwise.cli.main import build_parser, main
from draftwise.cli.serve import take_positional_model, worker_argv
from draftwise.entrypoints.api_server import build_parser as api_server_parser
from draftwise.flagtable import NO_EFFECT, SYNONYMS, add_flags, as_argv, config_values, table
from draftwise.worker.core.config import EngineConfig

TARGET, DRAFT = "meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-8B"
NOTICE = NO_EFFECT["block_size"][0][1]


@pytest.fixture(autouse=True)
def _no_local_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRAFTWISE_MODELS_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.chdir(tmp_path)


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _checkpoint(folder: Path, context: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return folder


def test_serve_takes_the_model_positionally() -> None:
    args = _serve(TARGET, "--speculative-model", DRAFT, "--num-speculative-tokens", "5", "--tensor-parallel-size", "4")
    assert take_positional_model(args) is None and args.model == TARGET
    config = engine_config(args)
    assert (config.model, config.speculative_model, config.spec_k, config.tensor_parallel_size) == (TARGET, DRAFT, 5, 4)
    args = _serve("--model", TARGET)  # --model stays
    assert take_positional_model(args) is None and args.model == TARGET
    args = _serve(TARGET, "--model", TARGET)  # both, the same: fine
    assert take_positional_model(args) is None and args.model == TARGET


def test_serve_refuses_two_different_models_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert take_positional_model(_serve("a/b", "--model", "c/d")) == (
        "the model is given twice: 'a/b' (positional) and --model 'c/d'; give one"
    )
    assert main(["serve", "folder-a", "--model", "folder-b"]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == "error: the model is given twice: 'folder-a' (positional) and --model 'folder-b'; give one\n"
    )


def test_draft_model_is_speculative_model_everywhere() -> None:
    assert SYNONYMS == {"speculative_model": ("--draft-model",)}
    args = _serve("--draft-model", "d")
    assert args.speculative_model == "d" and worker_argv(args) == ["--speculative-model", "d"]
    gen = build_parser().parse_args(["generate", "hi", "--draft-model", "d"])
    assert gen.speculative_model == "d"
    api = api_server_parser().parse_args(["--model", "m", "--draft-model", "d"])
    assert (api.model, api.speculative_model) == ("m", "d")
    flags = table(EngineConfig)  # what the worker's own parser is made from
    (spec,) = [f for f in flags if f.name == "speculative_model"]
    assert spec.option == "--speculative-model" and spec.aliases == ("--draft-model",)
    assert as_argv({"speculative_model": "d"}, flags) == ["--speculative-model", "d"]  # workers get the field's name


def test_use_v2_block_manager_is_accepted_with_a_notice(capsys: pytest.CaptureFixture[str]) -> None:
    assert NOTICE.startswith("notice: --use-v2-block-manager changes nothing: draftwise has one block manager")
    args = _serve("--use-v2-block-manager", "--block-size", "32")
    assert capsys.readouterr() == ("", NOTICE + "\n")
    assert args.use_v2_block_manager is True and worker_argv(args) == ["--block-size", "32"]  # not passed on
    for parser, argv in (
        (build_parser(), ["generate", "hi", "--use-v2-block-manager"]),
        (api_server_parser(), ["--use-v2-block-manager"]),
    ):
        parser.parse_args(argv)
        assert capsys.readouterr().err == NOTICE + "\n"
    p = argparse.ArgumentParser()
    add_flags(p, table(EngineConfig))  # the worker's parser: the same table
    parsed = p.parse_args(["--use-v2-block-manager"])
    assert capsys.readouterr().err == NOTICE + "\n"
    assert EngineConfig(**config_values(parsed, table(EngineConfig))) == EngineConfig()  # it sets nothing
    _serve()
    assert capsys.readouterr().err == ""  # not given: nothing said


def test_enable_chunked_prefill_switches_the_field() -> None:
    assert engine_config(_serve("--enable-chunked-prefill")).enable_chunked_prefill is True
    args = _serve("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096")
    assert engine_config(args).enable_chunked_prefill is False
    assert worker_argv(args) == ["--max-num-batched-tokens", "4096", "--no-enable-chunked-prefill"]
    assert EngineConfig().enable_chunked_prefill is True  # the default: on


def test_the_api_servers_port_is_http() -> None:
    args = api_server_parser().parse_args(["--model", "m", "--port", "8001", "--host", "0.0.0.0"])
    assert (args.http_port, args.port, args.host) == (8001, 0, "0.0.0.0")  # gRPC: any free port
    args = api_server_parser().parse_args(["--model", "m"])
    assert (args.http_port, args.port) == (8000, 0)  # vLLM's default HTTP port
    args = api_server_parser().parse_args(["--http-port", "9000", "--grpc-port", "50052"])
    assert (args.http_port, args.port) == (9000, 50052)
    assert _serve().http_port is None and _serve().port == 50051  # serve keeps its own ports


def test_an_unknown_hugging_face_name_fails_before_any_worker_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    problem = path_problem(engine_config(_serve("--model", TARGET)))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"--model: no local copy of {TARGET!r}: ") and "downloads nothing" in problem
    problem = path_problem(engine_config(_serve("--draft-model", DRAFT)))
    assert problem is not None and problem.startswith(f"--speculative-model: no local copy of {DRAFT!r}")
    assert main(["serve", TARGET]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: --model: no local copy of {TARGET!r}")
    assert main(["generate", "hi", "--model", TARGET]) == 2
    assert capsys.readouterr().err.startswith(f"error: --model: no local copy of {TARGET!r}")


def test_a_name_with_a_local_copy_passes_and_is_served_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftwise.cli.serve import use_local_copies

    monkeypatch.setenv("DRAFTWISE_MODELS_DIR", str(tmp_path / "models"))
    _checkpoint(tmp_path / "models" / TARGET, 8192)
    draft = _checkpoint(tmp_path / "models" / "Meta-Llama-3-8B", 8192)  # DIR/name also holds org/name
    args = _serve(TARGET, "--speculative-model", DRAFT, "--max-model-len", "4096")
    assert take_positional_model(args) is None and path_problem(engine_config(args)) is None
    use_local_copies(args)
    assert args.model_name == TARGET and args.speculative_model == str(draft)
    assert worker_argv(args)[:2] == ["--model", TARGET] and worker_argv(args)[-2:] == ["--model-name", TARGET]


def test_max_model_len_past_the_context_fails_before_any_worker(tmp_path: Path) -> None:
    target = _checkpoint(tmp_path / "target", 2048)
    draft = _checkpoint(tmp_path / "draft", 1024)
    assert context_problem(EngineConfig(model=target, max_model_len=2048)) is None
    assert context_problem(EngineConfig(model=target)) is None  # unset: the model's own
    assert context_problem(EngineConfig(model=target, max_model_len=4096)) == (
        f"--max-model-len 4096 is more than the model's context of 2048 tokens (max_position_embeddings in "
        f"{target / 'config.json'}): lower --max-model-len to 2048 or less"
    )
    problem = context_problem(EngineConfig(model=target, speculative_model=draft, max_model_len=2048))
    assert problem is not None and problem.startswith("--max-model-len 2048 is more than the draft model's context")
    assert path_problem(EngineConfig(model=target, max_model_len=4096)) is not None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert context_problem(EngineConfig(model=gguf, max_model_len=1 << 20)) is None  # not read here: the engine checks
