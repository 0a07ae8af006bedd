"""A chat message's content as text, in OpenAI's shapes: a string, or a list of
``{"type": "text", "text": ...}`` parts (joined). Shared by the worker (``LLM.chat``) and the
gateway's OpenAI endpoint, which must not import each other."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["text_content"]


def text_content(content: object, where: str) -> str:
    """``content`` as text; ValueError naming ``where`` (e.g. ``messages[2].content``) for
    anything else (images, audio: only text is served)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}}: only text is served"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where} must be a string or a list of text parts")
