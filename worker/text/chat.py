"""Chat input: messages rendered with the checkpoint's own chat template.

A chat request is a list of ``{"role": ..., "content": ...}`` messages. The worker renders
it with the tokenizer's ``chat_template`` (Jinja, as Hugging Face's ``apply_chat_template``
does, with ``add_generation_prompt=True``), tokenizes the text without adding special tokens
again (the template writes its own BOS), and adds the template's end-of-turn token to the
request's stop token ids, so that a reply ends where the model closes its turn.

Nothing here is specific to one template: the end-of-turn token is found by rendering a
probe conversation and reading which special token follows the assistant's message
(``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``</s>`` for Llama 2 and Mistral),
and a role outside ``STANDARD_ROLES`` is accepted only when the template renders it.

Tools (OpenAI function tools, assistant ``tool_calls``, ``tool`` messages with their results)
go through the template when it knows tools (a probe tool's name shows up when rendered with
``tools=``), as Hugging Face's ``apply_chat_template`` takes them; otherwise they are written
in Hermes style into plain messages (``chat_tools.hermes_messages``).
Every refusal is a ValueError whose message says what to change (INVALID_ARGUMENT over gRPC).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from draftwise.chat_content import text_content
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.chat_tools import ToolCall, check_tools, hermes_messages
from draftwise.worker.text.tokenizer import Tokenizer

STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Roles taken as known to every template; any other must show up in the rendered text."""
MAX_ROLE_CHARS = 64
"""Longest role name accepted."""
_PROBE = "draftwise-chat-probe-7f3a"
"""A marker put in messages to see where (and whether) the template renders them."""


def _string(m: Mapping[str, Any], key: str, where: str) -> str:
    value = m.get(key) or ""
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ChatMessage:
    """One message: who speaks and what; an assistant's tool calls; a tool result's call id and
    function name."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def check(self, where: str) -> None:
        """ValueError (naming ``where``, e.g. ``messages[3]``) for tool fields on the wrong role,
        a tool result without content, or a malformed call."""
        if self.tool_calls and self.role != "assistant":
            raise ValueError(
                f"{where}.tool_calls is set on a {self.role[:MAX_ROLE_CHARS]!r} message: only assistant messages call tools"
            )
        for j, call in enumerate(self.tool_calls):
            call.check(f"{where}.tool_calls[{j}]")
        if self.role == "tool" and not self.content:
            raise ValueError(f"{where}.content is empty: a tool message carries the tool's result")
        if self.tool_call_id and self.role != "tool":
            raise ValueError(
                f"{where}.tool_call_id is set on a {self.role[:MAX_ROLE_CHARS]!r} message: only tool messages answer a call"
            )

    def hf(self, where: str) -> dict[str, Any]:
        """The message as Hugging Face chat templates read it."""
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = [c.hf(f"{where}.tool_calls[{j}]") for j, c in enumerate(self.tool_calls)]
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name:
            m["name"] = self.name
        return m


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, oldest message first, and the tools the model may call. ``messages``
    also takes ``(role, content)`` pairs; ``tools`` OpenAI function tools (checked and
    normalized). ValueError naming the field for a malformed message or tool."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        given: tuple[Any, ...] = tuple(self.messages)  # (role, content) pairs are taken too
        msgs = tuple(m if isinstance(m, ChatMessage) else ChatMessage(*m) for m in given)
        for i, m in enumerate(msgs):
            m.check(f"messages[{i}]")
        object.__setattr__(self, "messages", msgs)
        object.__setattr__(self, "tools", check_tools(self.tools) if self.tools else ())

    @property
    def uses_tools(self) -> bool:
        """Whether it has tools, tool calls or tool results."""
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    @classmethod
    def from_messages(cls, messages: Sequence[Mapping[str, Any]], tools: object = None) -> ChatPrompt:
        """From OpenAI/vLLM-style dicts (``content`` a string or a list of ``{"type": "text"}``
        parts; ``tool_calls``, ``tool_call_id`` and ``name`` as OpenAI has them) and OpenAI's
        ``tools`` list; ValueError naming the message and field that is wrong."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
            role, content = m.get("role"), m.get("content", "")
            if not isinstance(role, str):
                raise ValueError(f"messages[{i}].role must be a string, got {type(role).__name__}")
            calls = m.get("tool_calls") or ()
            if isinstance(calls, str | bytes | Mapping) or not isinstance(calls, Sequence):
                raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls")
            call_id, name = (_string(m, key, f"messages[{i}]") for key in ("tool_call_id", "name"))
            out.append(
                ChatMessage(
                    role,
                    text_content(content, f"messages[{i}].content"),
                    tuple(ToolCall.from_openai(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)),
                    call_id,
                    name,
                )
            )
        return cls(tuple(out), check_tools(tools) if tools else ())

    def as_dicts(self) -> list[dict[str, Any]]:
        """The messages as Hugging Face chat templates read them (tool call arguments as dicts)."""
        return [m.hf(f"messages[{i}]") for i, m in enumerate(self.messages)]


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered and tokenized, ready for ``LLMEngine.add_request``."""

    text: str
    """The prompt text the template produced (generation prompt included)."""
    token_ids: list[int]
    """Its tokens (no special tokens added beyond what the template wrote)."""
    stop_token_ids: tuple[int, ...]
    """The template's end-of-turn token(s); empty when none could be found."""

    def sampling_params(self, params: SamplingParams | None, eos_token_ids: Sequence[int]) -> SamplingParams:
        """``params`` with the end-of-turn tokens added to its stop token ids (those that are
        not the model's EOS already, which ends generation anyway)."""
        params = params or SamplingParams()
        extra = [t for t in self.stop_token_ids if t not in eos_token_ids and t not in params.stop_token_ids]
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))


class ChatTemplate:
    """The chat template of one tokenizer. Renders off the engine thread: it only reads."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.hf: Any = tokenizer.hf
        template = getattr(self.hf, "chat_template", None)
        self.template: str | None = template if isinstance(template, str) and template.strip() else None

    @property
    def available(self) -> bool:
        return self.template is not None

    def _apply(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
            )
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            # (templates that index a message's fields raise more than TemplateError on shapes they do not expect)
            raise ValueError(f"the model's chat template refused the messages: {str(e)[:200]}") from None
        if not isinstance(text, str):  # pragma: no cover - tokenize=False always gives text
            raise ValueError("the model's chat template did not produce text")
        return text

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders tools given as ``tools=``: a probe tool's name shows up."""
        if self.template is None:
            return False
        tool = {"type": "function", "function": {"name": f"{_PROBE}_tool", "description": "probe", "parameters": {}}}
        try:
            text = self._apply([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=[tool])
        except ValueError:
            return False
        return f"{_PROBE}_tool" in text

    def _prepare(self, prompt: ChatPrompt, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list | None]:
        """What to hand the template: the messages (Hermes-style when the conversation uses tools
        and the template knows none) and the ``tools=`` argument."""
        if not prompt.uses_tools:
            return messages, None
        if self.supports_tools:
            return messages, list(prompt.tools) or None
        return hermes_messages(messages, prompt.tools), None

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text, generation prompt appended; ValueError for no template, no
        messages, an empty or unknown role, or a template that refuses the conversation."""
        if self.template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in its tokenizer config): send a text prompt, "
                "or serve an instruct model that has one"
            )
        if not prompt.messages:
            raise ValueError("chat has no messages: send at least one")
        odd: list[int] = []
        for i, m in enumerate(prompt.messages):
            role = m.role
            if not role:
                raise ValueError(f"messages[{i}].role is empty: use system, user, assistant or tool")
            if len(role) > MAX_ROLE_CHARS:
                raise ValueError(f"messages[{i}].role is {len(role)} characters; at most {MAX_ROLE_CHARS}")
            if role not in STANDARD_ROLES:
                odd.append(i)
        if odd:
            self._check_roles(prompt, odd)
        messages, tools = self._prepare(prompt, prompt.as_dicts())
        return self._apply(messages, add_generation_prompt=True, tools=tools)

    def _check_roles(self, prompt: ChatPrompt, odd: list[int]) -> None:
        """Render the conversation with a marker in each message of a non-standard role: a
        role is known when its marker and its name come out in the text. (The Hermes rewrite of
        a conversation with tools leaves such messages as they are.)"""
        probe = prompt.as_dicts()
        for i in odd:
            probe[i]["content"] = f"{_PROBE}{i}"
        messages, tools = self._prepare(prompt, probe)
        text = self._apply(messages, add_generation_prompt=True, tools=tools)
        for i in odd:
            role = prompt.messages[i].role
            if f"{_PROBE}{i}" not in text or role not in text:
                raise ValueError(
                    f"messages[{i}].role {role[:MAX_ROLE_CHARS]!r} is not a role this model's chat template knows: "
                    f"use {', '.join(sorted(STANDARD_ROLES))}"
                )

    @cached_property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token that closes an assistant turn in this template, found by
        rendering a probe reply and reading the first non-blank token after it."""
        if self.template is None:
            return ()
        try:
            text = self._apply(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                add_generation_prompt=False,
            )
        except ValueError:  # a template that wants another shape of conversation
            return ()
        at = text.rfind(_PROBE)
        if at < 0:
            return ()
        special: set[int] = set(getattr(self.hf, "all_special_ids", ()) or ())
        for tid, tok in (getattr(self.hf, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                special.add(int(tid))
        for t in self.hf.encode(text[at + len(_PROBE) :], add_special_tokens=False):
            if t in special:
                return (int(t),)
            if self.hf.decode([t]).strip():  # text before any special token: no end-of-turn token
                return ()
        return ()

    def encode(self, prompt: ChatPrompt, max_model_len: int, max_prompt_bytes: int | None) -> RenderedChat:
        """Render and tokenize; ValueError when the rendered prompt leaves no room for output."""
        text = self.render(prompt)
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if max_prompt_bytes is not None and size > max_prompt_bytes:
            raise ValueError(
                f"the chat messages render to {size} bytes, more than can fit in max_model_len={max_model_len} "
                f"tokens (at most {max_prompt_bytes} bytes of text): send fewer or shorter messages"
            )
        ids = list(self.hf.encode(text, add_special_tokens=False, verbose=False))
        if len(ids) >= max_model_len:
            raise ValueError(
                f"the chat messages render to a prompt of {len(ids)} tokens; it must be shorter than "
                f"max_model_len={max_model_len} to leave room for the reply: send fewer or shorter messages"
            )
        return RenderedChat(text, ids, self.end_of_turn_ids)
