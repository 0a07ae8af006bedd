"""Tool calling over OpenAI's HTTP, the request side: ``tools`` (function tools), ``tool_choice``,
``parallel_tool_calls``, and the history's assistant ``tool_calls`` and ``role: "tool"`` messages,
checked (400 naming the field) and mapped onto the contract.

What each ``tool_choice`` does:

- ``"none"``: the tools stay out of the prompt; a plain answer.
- ``"auto"`` (the default when tools are given): the tools go into the prompt
  (``ChatMessages.tools_json``: the worker renders them through the model's chat template, or
  Hermes-style when the template has no tools); the output is parsed for
  ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (:mod:`.tool_parsers`).
- ``"required"``: as auto, and the output is constrained by a JSON schema to a non-empty array of
  ``{"name": <a tool's name>, "arguments": <its parameters>}`` objects (one object without
  ``parallel_tool_calls``).
- ``{"type": "function", "function": {"name": f}}``: as auto, and the output is constrained to
  ``f``'s parameters schema: it is ``f``'s arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from draftwise.gateway.openai.api_error import ApiError, show
from draftwise.gateway.openai.structured import ConstraintSpec, schema_constraint
from draftwise.v1 import generation_pb2 as pb

MAX_TOOLS = 128
"""Most tools one request may define (OpenAI's limit)."""
MAX_NAME = 256
"""Longest tool name, in characters."""
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The parameters schema of a tool that gives none (a function without arguments)."""

Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and parameters schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        """OpenAI's tool definition, as the worker renders it into the prompt."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output is read for tool calls: ``mode``, the tools' names, the named
    function (mode ``named``) and whether several calls may be returned."""

    mode: Mode
    names: frozenset[str]
    named: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ToolRequest:
    """What a request's tool fields ask for: the tools' definitions for the prompt (JSON text; ""
    for none), the output constraint they impose (required, named) and how to read the output
    (None: as plain text)."""

    tools_json: str
    constraint: ConstraintSpec | None
    plan: ToolPlan | None


NO_TOOLS = ToolRequest("", None, None)


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """The tool fields of a chat body; ApiError(400) naming the field that is wrong."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, f"parallel_tool_calls must be true or false, got {show(parallel)}", "parallel_tool_calls")
    if choice is None:
        choice = "auto" if tools else "none"
    named: str | None = None
    if isinstance(choice, dict):
        named = _named(choice)
        mode = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise ApiError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
            f"got {show(choice)}",
            "tool_choice",
        )
    if mode == "none":
        return NO_TOOLS
    if not tools:
        raise ApiError(
            400, f"tool_choice {show(choice)} needs tools: tool calling takes a list of tools", "tool_choice"
        )
    by_name = {t.name: t for t in tools}
    if named is not None and named not in by_name:
        raise ApiError(
            400,
            f"tool_choice names the function {named!r:.80}, which is not among the tools ({', '.join(by_name)[:200]})",
            "tool_choice.function.name",
        )
    try:
        tools_json = json.dumps([t.definition() for t in tools], ensure_ascii=False)
    except RecursionError:
        raise ApiError(400, "tools are nested too deeply", "tools") from None
    parallel = parallel is not False
    plan = ToolPlan(mode, frozenset(by_name), named, parallel)
    constraint = None
    if mode == "required":  # (its schema nests the tools' parameters 5 deeper: checked like them)
        constraint = schema_constraint(required_schema(tools, parallel), "tool_choice")
    elif named is not None:
        constraint = schema_constraint(by_name[named].parameters, "tool_choice")
    return ToolRequest(tools_json, constraint, plan)


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: a non-empty array of calls, each
    ``{"name": <one tool's name>, "arguments": <that tool's parameters>}``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _tools(raw: object) -> list[Tool]:
    if raw is None or raw == []:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, f"tools must be a list of function tools, got {show(raw)}", "tools")
    if len(raw) > MAX_TOOLS:
        raise ApiError(400, f"tools lists {len(raw)} tools; at most {MAX_TOOLS}", "tools")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ApiError(400, f"{where} must be an object {{'type': 'function', 'function': {{...}}}}", where)
        if t.get("type") != "function":
            raise ApiError(
                400, f"{where}.type must be 'function' (only function tools are supported), got {show(t.get('type'))}",
                f"{where}.type",
            )  # fmt: skip
        tool = _function(t.get("function"), f"{where}.function")
        if tool.name in seen:
            raise ApiError(400, f"{where}.function.name {tool.name!r:.80} is defined twice", f"{where}.function.name")
        seen.add(tool.name)
        out.append(tool)
    return out


def _function(fn: object, where: str) -> Tool:
    if not isinstance(fn, dict):
        raise ApiError(400, f"{where} must be an object {{'name', 'description', 'parameters'}}, got {show(fn)}", where)
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
        raise ApiError(
            400, f"{where}.name must be a non-empty string of at most {MAX_NAME} characters", f"{where}.name"
        )
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ApiError(400, f"{where}.description must be a string, got {show(desc)}", f"{where}.description")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise ApiError(
            400, f"{where}.parameters must be a JSON schema (an object), got {show(params)}", f"{where}.parameters"
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{where}.strict must be true or false, got {show(strict)}", f"{where}.strict")
    schema_constraint(params, f"{where}.parameters")  # JSON a worker can read back, within the size limit
    return Tool(name, desc, params)


def _named(choice: dict[str, Any]) -> str:
    if choice.get("type") != "function":
        raise ApiError(
            400, f"tool_choice.type must be 'function' (a named function), got {show(choice.get('type'))}",
            "tool_choice.type",
        )  # fmt: skip
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError(
            400, "tool_choice.function.name must name one of the tools ({'type': 'function', 'function': {'name': ...}})",
            "tool_choice.function.name",
        )  # fmt: skip
    return name


# ---------------------------------------------------------------------- the history


def fill_message(msg: pb.ChatMessage, m: dict[str, Any], where: str) -> None:
    """The tool fields of history message ``m`` into ``msg``: an assistant's ``tool_calls``, a tool
    message's ``tool_call_id``, a ``name``; ApiError(400) naming the field that is wrong."""
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ApiError(400, f"{where}.name must be a string, got {show(name)}", f"{where}.name")
        msg.name = name
    calls = m.get("tool_calls")
    if calls is not None and calls != []:
        if msg.role != "assistant":
            raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool calls", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise ApiError(400, f"{where}.tool_calls must be a list of tool calls", f"{where}.tool_calls")
        for j, call in enumerate(calls):
            msg.tool_calls.append(_history_call(call, f"{where}.tool_calls[{j}]"))
    call_id = m.get("tool_call_id")
    if msg.role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise ApiError(
                400,
                f"{where}.tool_call_id must be the id of the tool call this message answers",
                f"{where}.tool_call_id",
            )
        if not msg.content:
            raise ApiError(
                400, f"{where}.content is empty: a tool message carries the tool's result", f"{where}.content"
            )
        msg.tool_call_id = call_id
    elif call_id not in (None, ""):
        raise ApiError(
            400,
            f"{where}.tool_call_id is set on a {msg.role[:64]!r} message: only tool messages answer a call",
            f"{where}.tool_call_id",
        )


def _history_call(call: object, where: str) -> pb.ToolCall:
    if not isinstance(call, dict):
        raise ApiError(400, f"{where} must be an object {{'id', 'type': 'function', 'function'}}", where)
    kind = call.get("type", "function")
    if kind != "function":
        raise ApiError(400, f"{where}.type must be 'function', got {show(kind)}", f"{where}.type")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise ApiError(400, f"{where}.id must be a string, got {show(call_id)}", f"{where}.id")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{where}.function must be an object {{'name', 'arguments'}}", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    args = fn.get("arguments", "")
    if isinstance(args, dict):  # some clients send the object itself
        args = json.dumps(args, ensure_ascii=False)
    param = f"{where}.function.arguments"
    if not isinstance(args, str):
        raise ApiError(400, f"{param} must be JSON text of an object, got {show(args)}", param)
    if args.strip():
        try:
            value = json.loads(args)
        except (ValueError, RecursionError):
            raise ApiError(400, f"{param} is not valid JSON: {show(args)}", param) from None
        if not isinstance(value, dict):
            raise ApiError(400, f"{param} must be a JSON object, got {show(args)}", param)
    return pb.ToolCall(id=call_id, name=name, arguments=args)
