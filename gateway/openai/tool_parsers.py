"""Tool calling over OpenAI's HTTP, the output side: a model's text read as content and tool calls,
incrementally, so that a stream and a whole response say the same.

A parser takes the output text as it comes (:meth:`Parser.feed`) and at the end
(:meth:`Parser.finish`), and returns items: :class:`Content` (text for ``message.content``),
:class:`CallStart` (a tool call: index, id, name, arguments so far) and :class:`ArgsDelta` (more
of a call's arguments). One parser per ``tool_choice`` mode:

- ``auto``: :class:`HermesParser` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (the Hermes format: Qwen2.5, Hermes, and any model whose prompt had the tools injected
  Hermes-style). Text outside the blocks is content; a block that is not a call of one of the tools
  (not JSON, no name, an unknown name) stays content, verbatim. Text that may be the start of a
  block is held back until it is known not to be. Whitespace next to a block is dropped.
- ``required``: :class:`ArrayParser` reads the constrained output, a JSON array of
  ``{"name", "arguments"}`` objects, one call per element as each element ends.
- ``named``: :class:`NamedParser`: the whole output is the named function's arguments, streamed as
  they come.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from draftwise.gateway.openai.tools import ToolPlan

START = "<tool_call>"
END = "</tool_call>"


def call_id() -> str:
    """A fresh tool call id, OpenAI's shape (``call_`` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


Item = Content | CallStart | ArgsDelta


@dataclass
class Parser:
    """The base of the parsers: the tools' names, how many calls were made."""

    plan: ToolPlan
    calls: int = 0
    _held_ws: str = field(default="", repr=False)

    def feed(self, text: str) -> list[Item]:
        raise NotImplementedError

    def finish(self) -> list[Item]:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> CallStart:
        self.calls += 1
        return CallStart(self.calls - 1, call_id(), name, arguments)

    def _content(self, text: str) -> list[Item]:
        """Content, its trailing whitespace held until more content follows (dropped before a block)."""
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        return [Content(body)] if body else []

    def _flush_ws(self) -> list[Item]:
        """At the end: held whitespace is content when no call was made (the text comes back whole)."""
        ws, self._held_ws = self._held_ws, ""
        return [Content(ws)] if ws and not self.calls else []


def as_call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` when ``body`` is a JSON object naming one of ``names`` with
    object arguments (or JSON text of an object, or none: ``{}``); else None."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:
        return obj["name"], json.dumps(args, ensure_ascii=False)
    except RecursionError:
        return None


def _held_prefix(text: str, token: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``token``."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


@dataclass
class HermesParser(Parser):
    """``auto``: Hermes ``<tool_call>`` blocks in free text."""

    _buf: str = ""
    _in_call: bool = False
    _ws_before: str = ""  # the whitespace before the open block

    def feed(self, text: str) -> list[Item]:
        self._buf += text
        out: list[Item] = []
        while True:
            if not self._in_call:
                i = self._buf.find(START)
                if i < 0:
                    keep = _held_prefix(self._buf, START)
                    out += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out += self._content(self._buf[:i])
                self._ws_before, self._held_ws = self._held_ws, ""  # dropped if the block is a call
                self._buf = self._buf[i + len(START) :]
                self._in_call = True
            else:
                j = self._buf.find(END)
                if j < 0:
                    return out
                body = self._buf[:j]
                self._buf = self._buf[j + len(END) :]
                self._in_call = False
                out += self._block(body, START + body + END)

    def finish(self) -> list[Item]:
        buf, self._buf = self._buf, ""
        out: list[Item] = []
        if self._in_call:  # a block never closed (the model stopped, or max_tokens): a call if it is whole
            self._in_call = False
            out += self._block(buf, START + buf)
        else:
            out += self._content(buf)
        return out + self._flush_ws()

    def _block(self, body: str, raw: str) -> list[Item]:
        call = as_call(body, self.plan.names)
        ws, self._ws_before = self._ws_before, ""
        if call is None:
            return self._content(ws + raw)
        if self.calls and not self.plan.parallel:
            return []  # parallel_tool_calls: false: the first call only
        return [self._call(*call)]


@dataclass
class ArrayParser(Parser):
    """``required``: a JSON array of ``{"name", "arguments"}`` objects. Anything that is not (an
    output the constraint did not hold, the rest of an array cut by max_tokens) is content."""

    _state: str = "start"  # start, array, element, done, text
    _elem: list[str] = field(default_factory=list)
    _pending: list[str] = field(default_factory=list)  # raw text since the last call (content if no call follows)
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        for pos, ch in enumerate(text):
            if self._state == "text":
                out += self._content(text[pos:])
                return out
            self._pending.append(ch)
            if self._state == "start":
                if ch == "[":
                    self._state = "array"
                elif not ch.isspace():
                    self._state = "text"
                    out += self._content("".join(self._pending))
                    self._pending = []
            elif self._state == "array":
                if ch == "{":
                    self._state, self._depth, self._elem = "element", 1, ["{"]
                elif ch == "]":
                    self._state = "done"
                elif not (ch.isspace() or ch == ","):
                    self._state = "text"
                    out += self._content("".join(self._pending))
                    self._pending = []
            elif self._state == "element":
                self._elem.append(ch)
                if self._scan(ch):
                    out += self._element()
            elif not ch.isspace():  # done: text after the array
                self._state = "text"
                out += self._content("".join(self._pending))
                self._pending = []
        return out

    def _scan(self, ch: str) -> bool:
        """Advance over one character of an element; True when the element is complete."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
        return self._depth == 0

    def _element(self) -> list[Item]:
        call = as_call("".join(self._elem), self.plan.names)
        self._elem = []
        if call is None:
            self._state = "text"
            out = self._content("".join(self._pending))
            self._pending = []
            return out
        self._state = "array"
        self._pending = []
        if self.calls and not self.plan.parallel:
            return []
        return [self._call(*call)]

    def finish(self) -> list[Item]:
        rest = "".join(self._pending)
        self._pending = []
        out: list[Item] = []
        if self.calls:
            rest = rest.strip().lstrip(",").strip()
            if rest not in ("", "]"):
                out += self._content(rest)  # a call cut short: its text, not a call
        elif rest:
            out += self._content(rest)
        return out + self._flush_ws()


@dataclass
class NamedParser(Parser):
    """A named function: the whole output is its arguments (leading and trailing whitespace dropped)."""

    _index: int | None = None

    def feed(self, text: str) -> list[Item]:
        if self._index is None:
            text = text.lstrip()
            if not text:
                return []
            assert self.plan.named is not None
            start = self._call(self.plan.named, "")
            self._index = start.index
            return [start, *self._args(text)]
        return self._args(text)

    def _args(self, text: str) -> list[Item]:
        assert self._index is not None
        return [ArgsDelta(self._index, c.text) for c in self._content(text) if isinstance(c, Content)]

    def finish(self) -> list[Item]:
        self._held_ws = ""
        return []


def new_parser(plan: ToolPlan) -> Parser:
    """The parser of ``plan``'s mode."""
    if plan.mode == "required":
        return ArrayParser(plan)
    if plan.mode == "named":
        return NamedParser(plan)
    return HermesParser(plan)


# ---------------------------------------------------------------------- OpenAI's shapes


def message(plan: ToolPlan, text: str) -> dict[str, Any]:
    """The assistant message of a whole output: ``content`` (None when only calls were made) and
    ``tool_calls`` (when any)."""
    parser = new_parser(plan)
    items = parser.feed(text) + parser.finish()
    content = "".join(i.text for i in items if isinstance(i, Content))
    calls: list[dict[str, Any]] = []
    for i in items:
        if isinstance(i, CallStart):
            calls.append({"id": i.id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}})
        elif isinstance(i, ArgsDelta):
            calls[i.index]["function"]["arguments"] += i.text
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def delta(items: list[Item]) -> dict[str, Any]:
    """A stream chunk's ``delta`` of ``items``: ``content`` and ``tool_calls`` (each with its
    ``index``; a call's first delta has its id, type and name); {} when there is nothing to say."""
    out: dict[str, Any] = {}
    text = "".join(i.text for i in items if isinstance(i, Content))
    if text:
        out["content"] = text
    calls: list[dict[str, Any]] = []
    for i in items:
        if isinstance(i, CallStart):
            fn = {"name": i.name, "arguments": i.arguments}
            calls.append({"index": i.index, "id": i.id, "type": "function", "function": fn})
        elif isinstance(i, ArgsDelta):
            if calls and calls[-1]["index"] == i.index:
                calls[-1]["function"]["arguments"] += i.text
            else:
                calls.append({"index": i.index, "function": {"arguments": i.text}})
    if calls:
        out["tool_calls"] = calls
    return out
