"""Checks the gateway makes before routing a request: the model, the prompt's shape and the
sampling parameters (:mod:`draftwise.gateway.sampling_check`); the worker checks the rest (the
prompt's length in tokens, prompt + max_tokens against the context, ...)."""

from __future__ import annotations

import json
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from draftwise.gateway.core import Core
from draftwise.gateway.errors import RequestError, clip
from draftwise.gateway.sampling_check import check_sampling
from draftwise.v1 import generation_pb2 as pb

M = TypeVar("M", bound=Message)


def too_large(size: int, max_bytes: int) -> RequestError:
    """The INVALID_ARGUMENT of a ``size``-byte message over the ``max_bytes`` limit."""
    return RequestError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is {size} bytes; this server accepts at most {max_bytes} bytes per message "
        "(--max-request-bytes): send a shorter prompt (or fewer stop strings)",
    )


def parse_request(data: bytes, message_type: type[M], max_bytes: int) -> M:
    """``data`` (a client message as it came off the wire) parsed as ``message_type``;
    RequestError(INVALID_ARGUMENT) when it is larger than ``max_bytes`` or cannot be parsed.
    The handlers get raw bytes and call this, so that a bad message is an answer, not a
    deserializer exception that gRPC swallows."""
    if len(data) > max_bytes:
        raise too_large(len(data), max_bytes)
    try:
        return message_type.FromString(data)
    except DecodeError as e:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"malformed message: {len(data)} bytes that do not parse as {message_type.DESCRIPTOR.full_name} "
            f"({clip(str(e))})",
        ) from None


def validate_start(core: Core, start: pb.StartGeneration) -> str:
    """The model to serve ``start`` with; RequestError (INVALID_ARGUMENT, UNAVAILABLE) when
    it cannot be served. Sampling parameters are checked first: a bad one is INVALID_ARGUMENT
    even while no worker is up."""
    check_sampling(start.sampling_params, start.speculation if start.HasField("speculation") else None)
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
            grpc.StatusCode.INVALID_ARGUMENT,
            f"unknown model {clip(model)!r}; this server serves: {served} (see ListModels)",
        )
    kind = start.prompt.WhichOneof("kind")
    if kind is None:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: set prompt.text, prompt.token_ids or prompt.chat"
        )
    if kind == "text" and not start.prompt.text:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt.text is empty")
    if kind == "chat":
        validate_chat(start.prompt.chat)
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
        sp = start.sampling_params
        if limit and sp.HasField("max_tokens") and n + sp.max_tokens > limit:  # the worker checks text prompts
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_tokens={sp.max_tokens} is too large: the prompt is {n} tokens and prompt + max_tokens "
                f"({n + sp.max_tokens}) must be at most max_model_len={limit}; ask for at most {limit - n} tokens",
            )
    return model


MAX_ROLE_CHARS = 64
"""Longest chat role name accepted (the worker checks the role against the model's template)."""


def validate_chat(chat: pb.ChatMessages) -> None:
    """RequestError(INVALID_ARGUMENT) for a chat with no messages, an empty or overlong role,
    malformed tools (:func:`validate_tools`), tool calls on a message that is not the
    assistant's or without a name or with arguments that are not a JSON object, or a tool
    message without content (the worker's rules); whether the model has a template and knows
    each role is the worker's to say."""
    validate_tools(chat.tools_json)
    if not chat.messages:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat has no messages: send at least one")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt.chat.messages[{i}].role is empty: use system, user, assistant or tool",
            )
        if len(m.role) > MAX_ROLE_CHARS:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt.chat.messages[{i}].role is {len(m.role)} characters ({clip(m.role)!r}); at most {MAX_ROLE_CHARS}",
            )
        _validate_tool_fields(m, f"prompt.chat.messages[{i}]")


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _invalid(f"{where} is not valid JSON ({clip(str(e))})") from None
    except RecursionError:
        raise _invalid(f"{where} is nested too deeply") from None


def _validate_tool_fields(m: pb.ChatMessage, where: str) -> None:
    if m.tool_calls and m.role != "assistant":
        raise _invalid(f"{where}.tool_calls is set on a {clip(m.role)!r} message: only assistant messages call tools")
    for j, call in enumerate(m.tool_calls):
        if not call.name:
            raise _invalid(f"{where}.tool_calls[{j}].name is empty: a tool call names the function it calls")
        if call.arguments.strip() and not isinstance(_json(call.arguments, f"{where}.tool_calls[{j}].arguments"), dict):
            raise _invalid(f"{where}.tool_calls[{j}].arguments must be a JSON object")
    if m.role == "tool" and not m.content:
        raise _invalid(f"{where}.content is empty: a tool message carries the tool's result")
    if m.tool_call_id and m.role != "tool":
        raise _invalid(f"{where}.tool_call_id is set on a {clip(m.role)!r} message: only tool messages answer a call")


def validate_tools(tools_json: str) -> None:
    """RequestError(INVALID_ARGUMENT) unless ``tools_json`` is empty or a JSON array of OpenAI
    function tools ``{"type": "function", "function": {"name", "description", "parameters"}}``
    with unique, non-empty names (the worker's rules)."""
    where = "prompt.chat.tools_json"
    if not tools_json.strip():
        return
    tools = _json(tools_json, where)
    if not isinstance(tools, list):
        raise _invalid(f"{where} must be a JSON array of function tools, got {type(tools).__name__}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _invalid(
                f"{at} must be an object {{'type': 'function', 'function': {{...}}}} (only function tools are served)"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _invalid(f"{at}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{at}.function.name must be a non-empty string")
        if name in names:
            raise _invalid(f"{at}.function.name {clip(name)!r} is given twice: tool names must be unique")
        names.add(name)
        for key, kind, ok in (
            ("description", "a string", str),
            ("parameters", "a JSON Schema object", dict),
            ("strict", "true or false", bool),
        ):
            if fn.get(key) is not None and not isinstance(fn[key], ok):
                raise _invalid(f"{at}.function.{key} must be {kind}")
