"""The worker's rules for sampling parameters, checked at the gateway, so that a bad request is
INVALID_ARGUMENT (HTTP 400) at once, whether or not a worker is up to say so (vLLM's ranges, as
``SamplingParams`` in the worker checks them; the worker checks again).

A structured-output constraint is checked for its shape only (the worker's ``Constraint``
rules: non-empty, bounded text, a schema that is a JSON object or boolean, a bounded list of
non-empty choices, not with ignore_eos or min_tokens); whether it compiles against the model's
vocabulary only a worker can say."""

from __future__ import annotations

import json
import math

import grpc

from draftwise.gateway.errors import RequestError, clip
from draftwise.v1 import generation_pb2 as pb

MAX_LOGPROBS = 20
"""Most top-n log-probabilities a request may ask for per token (the worker's MAX_LOGPROBS)."""
MAX_CONSTRAINT_BYTES = 256 * 1024
"""Largest schema, regex or grammar text in UTF-8 bytes, and largest choice list in total (the worker's)."""
MAX_CHOICES = 1024
"""Most strings a choice constraint may list (the worker's MAX_CHOICES)."""


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
    if spec is not None:
        check_methods(spec)
    check_constraint(sp)


SPECULATIVE_METHOD_NAMES = ("draft", "eagle", "medusa", "ngram", "suffix")
"""Names a request's speculation.methods may hold (the worker's SamplingParams checks the same)."""


def check_methods(spec: pb.SpeculationOptions) -> None:
    """FieldError ``methods`` for an unknown name or more names than there are methods."""
    if len(spec.methods) > len(SPECULATIVE_METHOD_NAMES):
        raise FieldError("methods", f"speculation.methods holds at most {len(SPECULATIVE_METHOD_NAMES)} names")
    for name in spec.methods:
        if name not in SPECULATIVE_METHOD_NAMES:
            raise FieldError(
                "methods",
                f"speculation.methods: unknown method {clip(name)!r}; known: {', '.join(SPECULATIVE_METHOD_NAMES)}",
            )


def check_constraint(sp: pb.SamplingParams) -> None:
    """FieldError naming the constraint kind (the oneof's field) when its shape is wrong, or
    ``ignore_eos`` / ``min_tokens`` when either comes with a constraint."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return
    if kind == "json_object":
        if not sp.json_object:
            raise FieldError(kind, "json_object must be true when set (leave it unset for no constraint)")
    elif kind == "choice":
        options = sp.choice.options
        if not options:
            raise FieldError(kind, "a choice constraint needs at least one string: choice.options is empty")
        if len(options) > MAX_CHOICES:
            raise FieldError(kind, f"a choice constraint may list at most {MAX_CHOICES} strings, got {len(options)}")
        if any(not o for o in options):
            raise FieldError(kind, "the choice options must be non-empty strings, got ''")
        if sum(len(o.encode()) for o in options) > MAX_CONSTRAINT_BYTES:
            raise FieldError(kind, f"the choice options are larger than {MAX_CONSTRAINT_BYTES} bytes in total")
    else:
        _check_constraint_text(kind, getattr(sp, kind))
    for name, bad in (("ignore_eos", sp.ignore_eos), ("min_tokens", sp.min_tokens > 0)):
        if bad:
            raise FieldError(
                name,
                f"{name} cannot be combined with a {kind} constraint: the constraint decides where the output ends",
            )


def _check_constraint_text(kind: str, text: str) -> None:
    """A json_schema, regex or grammar: non-empty, at most MAX_CONSTRAINT_BYTES, a schema JSON."""
    if not text.strip():
        raise FieldError(kind, f"the {kind} constraint is empty")
    size = len(text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise FieldError(kind, f"the {kind} constraint is {size} bytes; at most {MAX_CONSTRAINT_BYTES}")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise FieldError(kind, f"the json_schema constraint is not valid JSON ({clip(str(e))})") from None
        if not isinstance(schema, dict | bool):
            raise FieldError(kind, f"a json_schema must be a JSON object or a boolean, got {type(schema).__name__}")
