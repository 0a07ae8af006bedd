"""The engine side of draftwise: model loading, the model runtime over a paged KV cache,
and (in later layers) scheduling, sampling, speculative decoding and the gRPC servicer."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).parent / "default_models"


def default_model_path(which: str = "target") -> Path:
    """Folder of an embedded default checkpoint: ``"target"`` or ``"draft"``."""
    if which not in ("target", "draft"):
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    return DEFAULT_MODELS_DIR / which
