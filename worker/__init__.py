"""The engine side of draftwise: model loading, the model runtime over a paged KV cache,
scheduling, sampling and the offline API.

    from draftwise.worker import LLM, SamplingParams
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from draftwise.worker.llm import LLM
    from draftwise.worker.sampling_params import SamplingParams

DEFAULT_MODELS_DIR = Path(__file__).parent / "default_models"

__all__ = ["LLM", "SamplingParams", "default_model_path", "DEFAULT_MODELS_DIR"]


def default_model_path(which: str = "target") -> Path:
    """Folder of an embedded default checkpoint: ``"target"`` or ``"draft"``."""
    if which not in ("target", "draft"):
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    return DEFAULT_MODELS_DIR / which


def __getattr__(name: str) -> Any:  # lazy: importing the package stays cheap
    if name == "LLM":
        from draftwise.worker.llm import LLM

        return LLM
    if name == "SamplingParams":
        from draftwise.worker.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'draftwise.worker' has no attribute {name!r}")
