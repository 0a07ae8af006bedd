"""The worker's rules for sampling parameters, checked at the gateway, so that a bad request is
INVALID_ARGUMENT (HTTP 400) at once, whether or not a worker is up to say so (vLLM's ranges, as
``SamplingParams`` in the worker checks them; the worker checks again)."""

from __future__ import annotations

import math

import grpc

from draftwise.gateway.errors import RequestError
from draftwise.v1 import generation_pb2 as pb

MAX_LOGPROBS = 20
"""Most top-n log-probabilities a request may ask for per token (the worker's MAX_LOGPROBS)."""


class FieldError(RequestError):
    """INVALID_ARGUMENT for one field of the request, named by ``param`` (OpenAI's name for it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.param = param


def _float(sp: pb.SamplingParams, name: str, allowed: str, ok: bool) -> None:
    v = getattr(sp, name)
    if not math.isfinite(v) or not ok:
        raise FieldError(name, f"{name} must be {allowed}, got {v!r}")


def check_sampling(sp: pb.SamplingParams, spec: pb.SpeculationOptions | None = None) -> None:
    """FieldError naming the first sampling parameter out of its range (the worker's rules)."""
    if sp.HasField("temperature"):
        _float(sp, "temperature", "a finite number >= 0", sp.temperature >= 0)
    if sp.HasField("top_p"):
        _float(sp, "top_p", "in (0, 1]", 0 < sp.top_p <= 1)
    if sp.top_k < -1:
        raise FieldError("top_k", f"top_k must be -1, 0 (disabled) or >= 1, got {sp.top_k}")
    _float(sp, "min_p", "in [0, 1]", 0 <= sp.min_p <= 1)
    if sp.HasField("max_tokens") and sp.max_tokens < 1:
        raise FieldError("max_tokens", f"max_tokens must be >= 1, got {sp.max_tokens}")
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 16
    if sp.min_tokens > max_tokens:
        raise FieldError("min_tokens", f"min_tokens must be <= max_tokens ({max_tokens}), got {sp.min_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        _float(sp, name, "in [-2, 2]", -2 <= getattr(sp, name) <= 2)
    if sp.HasField("repetition_penalty"):
        _float(sp, "repetition_penalty", "> 0", sp.repetition_penalty > 0)
    if sp.HasField("logprobs") and sp.logprobs > MAX_LOGPROBS:
        raise FieldError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {sp.logprobs}")
    if any(not s for s in sp.stop):
        raise FieldError("stop", "stop strings must be non-empty, got ''")
    if spec is not None and spec.HasField("max_speculative_tokens") and spec.max_speculative_tokens < 1:
        raise FieldError(
            "max_speculative_tokens",
            f"speculation.max_speculative_tokens must be >= 1, got {spec.max_speculative_tokens}",
        )
