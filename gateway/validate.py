"""Checks the gateway makes before routing a request (the worker checks the rest: sampling
parameters, prompt length in tokens, ...)."""

from __future__ import annotations

import grpc

from draftwise.gateway.relay import Core, RequestError
from draftwise.v1 import generation_pb2 as pb


def validate_start(core: Core, start: pb.StartGeneration) -> str:
    """The model to serve ``start`` with; RequestError (INVALID_ARGUMENT, UNAVAILABLE) when
    it cannot be served."""
    models = core.router.models()
    model = start.model or core.default_model()
    if model is None:
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"no worker has reported its model yet ({core.router.describe()}); retry shortly",
        )
    if model not in models:
        served = ", ".join(repr(m) for m in sorted(models)) or "none yet"
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"unknown model {model!r}; this server serves: {served} (see ListModels)"
        )
    kind = start.prompt.WhichOneof("kind")
    if kind is None:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: set prompt.text or prompt.token_ids")
    if kind == "text" and not start.prompt.text:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt.text is empty")
    if kind == "token_ids":
        n = len(start.prompt.token_ids.ids)
        if n == 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids is empty")
        limit = models[model]
        if limit and n >= limit:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt is {n} tokens; it must be shorter than the context length of {model!r} ({limit}) "
                "to leave room for output",
            )
    return model
