"""Hugging Face model names (``meta-llama/Meta-Llama-3-8B``) resolved to a local copy, offline:
a folder of ``DRAFTWISE_MODELS_DIR`` (``org/name`` or ``name``) or a snapshot in the Hugging Face
cache, read through huggingface_hub or, without it, by hand; otherwise one line saying what to
pass instead. Aliases and paths keep their meaning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from draftwise.worker import paths

NAME = "meta-llama/Meta-Llama-3-8B"


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    return folder


def _hub_cache(root: Path, name: str, commit: str = "0123abcd") -> Path:
    """``name`` as huggingface_hub caches it: refs/main naming a snapshot that holds config.json."""
    org, base = name.split("/")
    repo = root / f"models--{org}--{base}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return _checkpoint(repo / "snapshots" / commit)


@pytest.fixture(autouse=True)
def _empty_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No models folder and an empty Hugging Face cache, whatever the machine has."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", paths.MODELS_DIR_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)


def test_what_reads_as_a_hugging_face_name(tmp_path: Path) -> None:
    assert paths.is_hub_name(NAME) and paths.is_hub_name("Qwen/Qwen2.5-0.5B-Instruct")
    assert paths.is_model_name(NAME)  # missing_paths leaves it to the name checks
    for not_a_name in ("target", "/abs/folder", "./a/b", "a/b/c", "a/b.gguf", "smollm2-135m-instruct", "default", ""):
        assert not paths.is_hub_name(not_a_name), not_a_name
    _checkpoint(tmp_path / "org" / "model")  # an existing relative path stays a path
    assert not paths.is_hub_name("org/model")
    assert paths.resolve_model("org/model") == Path("org/model")


def test_aliases_paths_and_default_keep_their_meaning(tmp_path: Path) -> None:
    assert paths.resolve_model(None) == paths.resolve_model("default") == paths.DEFAULT_MODELS_DIR / "target"
    assert paths.resolve_model(tmp_path / "x") == tmp_path / "x"  # a path, existing or not
    assert paths.resolve_model("folder/x.gguf") == Path("folder/x.gguf")
    assert paths.is_model_name("default") and paths.is_model_name("SmolLM2-135M-Instruct")


def test_a_models_dir_holds_org_name_or_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    by_org = _checkpoint(second / "meta-llama" / "Meta-Llama-3-8B")
    monkeypatch.setenv(paths.MODELS_DIR_ENV, f"{first}:{second}")
    assert paths.resolve_model(NAME) == by_org
    by_name = _checkpoint(first / "Meta-Llama-3-8B")  # the first folder wins
    assert paths.resolve_model(NAME) == by_name
    gguf_folder = first / "Qwen2.5-0.5B-GGUF"
    gguf_folder.mkdir()
    (gguf_folder / "model.Q4_0.gguf").write_bytes(b"GGUF")
    assert paths.resolve_model("Qwen/Qwen2.5-0.5B-GGUF") == gguf_folder / "model.Q4_0.gguf"
    (gguf_folder / "model.Q8_0.gguf").write_bytes(b"GGUF")  # two files: which one is not known
    with pytest.raises(FileNotFoundError):
        paths.resolve_model("Qwen/Qwen2.5-0.5B-GGUF")
    (first / "empty").mkdir()  # a folder that is no checkpoint is no copy
    assert paths.find_local_copy("org/empty") is None


def test_the_hugging_face_cache_through_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _hub_cache(tmp_path / "hf-home" / "hub", NAME)
    assert paths.hub_cache_dir() == tmp_path / "hf-home" / "hub"
    assert paths.resolve_model(NAME) == snapshot
    other = _hub_cache(tmp_path / "elsewhere", NAME, "feedbeef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # read at each call, not at import
    assert paths.resolve_model(NAME) == other
    monkeypatch.setenv(paths.MODELS_DIR_ENV, str(tmp_path / "models"))
    mine = _checkpoint(tmp_path / "models" / NAME)
    assert paths.resolve_model(NAME) == mine  # the models folder comes first


def test_the_hugging_face_cache_read_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails: the fallback reads the layout
    assert paths.find_local_copy(NAME) is None
    snapshot = _hub_cache(tmp_path / "hf-home" / "hub", NAME)
    assert paths.resolve_model(NAME) == snapshot
    (snapshot / "config.json").unlink()  # a snapshot without config.json is no checkpoint
    assert paths.find_local_copy(NAME) is None


def test_the_cache_folder_follows_huggingface_hubs_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert paths.hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert paths.hub_cache_dir() == tmp_path / "hub"


@pytest.mark.parametrize("name", ["a/b--c", "a/b.", "a/b..", "a-/b", "a/" + "x" * 120])
def test_a_name_the_hub_would_refuse_has_no_copy(name: str) -> None:
    assert paths.is_hub_name(name) and paths.find_local_copy(name) is None
    with pytest.raises(FileNotFoundError, match="no local copy"):
        paths.resolve_model(name)


def test_no_local_copy_is_one_line_saying_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        paths.resolve_model(NAME)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"no local copy of {NAME!r}: ")
    for said in ("DRAFTWISE_MODELS_DIR (unset)", str(tmp_path / "hf-home" / "hub"), "downloads nothing"):
        assert said in message
    for what in ("a local checkpoint folder", "a GGUF file", "a model alias such as smollm2-135m-instruct"):
        assert what in message
