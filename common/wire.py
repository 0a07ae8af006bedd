"""What the gateway and the workers share on the wire (no torch here: the gateway imports it):
gRPC metadata keys, and a helper for the server interceptors of both.

A worker answers ``GetLoad`` with the keys as trailing metadata; the gateway's router reads
them and ``ListModels`` reports them. A worker refusing a continuation that is a whole output
(INVALID_ARGUMENT) says why that output ended in the ``FINISHED_*`` keys: a gateway whose worker
died between a request's last token and its final event finishes the request with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

MAX_MODEL_LEN_KEY = "draftwise-max-model-len"
"""The worker's context length (prompt + output tokens of one request)."""
SPEC_METHOD_KEY = "draftwise-speculative-method"
""""draft", "ngram", "eagle", "medusa" or "suffix"; absent when the worker does not speculate."""
DRAFT_MODEL_KEY = "draftwise-draft-model"
"""The drafter's name, with speculative method "draft" (the draft model), "eagle" or "medusa" (the head)."""
SPEC_TOKENS_KEY = "draftwise-num-speculative-tokens"
"""The most tokens drafted per request per step."""
FINISHED_REASON_KEY = "draftwise-continuation-finished"
""""length" or "stop": the refused continuation is a whole output, which ended so."""
FINISHED_STOP_TOKEN_KEY = "draftwise-stop-token-id"
"""With "stop": the stop token id (of ``SamplingParams.stop_token_ids``) it ended on; absent for EOS."""
FINISHED_STOP_STR_KEY = "draftwise-stop-str-bin"
"""With "stop": the stop string (UTF-8) its text ended on."""


def handler_like(
    handler: grpc.RpcMethodHandler,
    behaviour: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A method handler of ``handler``'s kind (request and response streaming or not) that
    runs ``behaviour`` with ``handler``'s response serializer: what a server interceptor
    returns to refuse a call or to wrap its handler."""
    kwargs = {"request_deserializer": request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kwargs)
