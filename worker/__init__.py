"""The engine side of draftwise: model loading, the model runtime over a paged KV cache,
scheduling, sampling and the offline API.

    from draftwise.worker import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from draftwise.worker.paths import DEFAULT_MODELS_DIR, default_model_path

if TYPE_CHECKING:
    from draftwise.worker.engine.llm import LLM
    from draftwise.worker.sampling.constraints import Constraint
    from draftwise.worker.sampling.sampling_params import SamplingParams

__all__ = ["LLM", "Constraint", "SamplingParams", "default_model_path", "DEFAULT_MODELS_DIR"]


def __getattr__(name: str) -> Any:  # lazy: importing the package stays cheap
    if name == "LLM":
        from draftwise.worker.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from draftwise.worker.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "Constraint":
        from draftwise.worker.sampling.constraints import Constraint

        return Constraint
    raise AttributeError(f"module 'draftwise.worker' has no attribute {name!r}")
