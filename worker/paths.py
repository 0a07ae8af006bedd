"""Where the embedded default checkpoints are (a module of its own: the engine needs it, and
the package's ``__init__`` must not be part of an import cycle)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).parent / "default_models"

__all__ = ["DEFAULT_MODELS_DIR", "default_model_path"]


def default_model_path(which: str = "target") -> Path:
    """Folder of an embedded default checkpoint: ``"target"`` or ``"draft"``."""
    if which not in ("target", "draft"):
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    return DEFAULT_MODELS_DIR / which
