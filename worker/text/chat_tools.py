"""Tools in a chat: the function tools a model may call, the calls it made, and how both are
written into the prompt.

Tools come as OpenAI defines them, ``{"type": "function", "function": {"name", "description",
"parameters"}}``; a call as ``{"id", "type": "function", "function": {"name", "arguments"}}``
with ``arguments`` JSON text. A chat template that knows tools (Qwen2.5, Llama 3.1, Hermes,
Mistral) is handed them as Hugging Face's ``apply_chat_template(tools=...)`` expects
(``chat.ChatTemplate`` decides). For a template that does not (SmolLM2's), :func:`hermes_messages`
writes them into the conversation the way Hermes and Qwen2.5 templates do: a ``<tools>`` block and
the answer format in the system message, each call as a ``<tool_call>`` block of JSON in the
assistant's text, and tool results as ``<tool_response>`` blocks of a user turn. A reply to such
a prompt is parsed by looking for ``<tool_call>`` blocks (the OpenAI endpoint's parser).

Every refusal is a ValueError naming the field (INVALID_ARGUMENT over gRPC).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
HERMES_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_FORMAT = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
"""The system message's tools block, as Qwen2.5's template writes it (the tools, one JSON per
line, go between the two)."""


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool in an assistant message; ``arguments`` is JSON text of an
    object ("" for none)."""

    id: str
    name: str
    arguments: str = ""

    def parsed_arguments(self, where: str = "tool_calls[0]") -> dict[str, Any]:
        """The arguments as a dict; ValueError naming ``where`` when they are not a JSON object."""
        if not self.arguments.strip():
            return {}
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.arguments is not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{where}.arguments is nested too deeply") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}.arguments must be a JSON object, got {type(value).__name__}")
        return value

    def hf(self, where: str) -> dict[str, Any]:
        """The call as Hugging Face chat templates read it (arguments as a dict)."""
        function = {"name": self.name, "arguments": self.parsed_arguments(where)}
        return {"id": self.id, "type": "function", "function": function}

    @classmethod
    def from_openai(cls, data: object, where: str) -> ToolCall:
        """From OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``
        (``arguments`` JSON text, or a dict, which is written out as JSON)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be an object with 'id' and 'function', got {type(data).__name__}")
        if data.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {data.get('type')!r:.40}")
        fn = data.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function must be an object with 'name' and 'arguments'")
        call_id, name, args = data.get("id", ""), fn.get("name"), fn.get("arguments", "")
        if not isinstance(call_id, str):
            raise ValueError(f"{where}.id must be a string, got {type(call_id).__name__}")
        if isinstance(args, Mapping):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise ValueError(f"{where}.function.arguments must be JSON text, got {type(args).__name__}")
        call = cls(call_id, name if isinstance(name, str) else "", args)
        call.check(where)
        return call

    def check(self, where: str) -> None:
        """ValueError for a call without a function name or with arguments that are not a JSON object."""
        if not self.name:
            raise ValueError(f"{where}.name is empty: a tool call names the function it calls")
        self.parsed_arguments(where)


def check_tools(tools: object, where: str = "tools") -> tuple[dict[str, Any], ...]:
    """``tools`` checked as a list of OpenAI function tools, each returned as
    ``{"type": "function", "function": {"name", ["description"], ["parameters"]}}``; ValueError
    naming ``where`` (and the tool's index) for anything else."""
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise ValueError(f"{where} must be a JSON array of function tools, got {type(tools).__name__}")
    out = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{at} must be an object {{'type': 'function', 'function': {{...}}}}")
        if tool.get("type") != "function":
            raise ValueError(
                f"{at}.type must be 'function' (only function tools are served), got {tool.get('type')!r:.40}"
            )
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{at}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"{at}.function.name {name[:64]!r} is given twice: tool names must be unique")
        names.add(name)
        entry: dict[str, Any] = {"name": name}
        if "description" in fn and fn["description"] is not None:
            if not isinstance(fn["description"], str):
                raise ValueError(f"{at}.function.description must be a string")
            entry["description"] = fn["description"]
        if "parameters" in fn and fn["parameters"] is not None:
            if not isinstance(fn["parameters"], Mapping):
                raise ValueError(f"{at}.function.parameters must be a JSON Schema object")
            entry["parameters"] = dict(fn["parameters"])
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):  # (a grammar's business; not rendered)
            raise ValueError(f"{at}.function.strict must be true or false")
        out.append({"type": "function", "function": entry})
    return tuple(out)


def tools_from_json(text: str, where: str = "tools_json") -> tuple[dict[str, Any], ...]:
    """The tools of a JSON array (``ChatMessages.tools_json``); "" is no tools."""
    if not text.strip():
        return ()
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply") from None
    return check_tools(tools, where)


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as a Hermes ``<tool_call>`` block."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def hermes_system(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message's tools block: the tools and how to call them."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{HERMES_PREAMBLE}{lines}\n{HERMES_FORMAT}"


def hermes_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (Hugging Face's form: assistant ``tool_calls`` with dict arguments, ``tool``
    messages) rewritten as plain role/content messages for a template that knows no tools: the
    tools block appended to the system message (or a system message added), each assistant call
    a ``<tool_call>`` block after its text, and each run of tool results one user turn of
    ``<tool_response>`` blocks. Messages of other roles pass unchanged."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        block = hermes_system(tools)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolCall",
    "check_tools",
    "hermes_messages",
    "hermes_system",
    "tool_call_text",
    "tools_from_json",
]
