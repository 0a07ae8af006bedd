"""Structured output: what a request's output must match (``SamplingParams(constraint=...)``).

    from draftwise_client import Constraint, SamplingParams

    SamplingParams(max_tokens=64, constraint=Constraint.json_schema({"type": "object", ...}))
    SamplingParams(constraint=Constraint.json_object())          # any JSON object
    SamplingParams(constraint=Constraint.regex(r"[a-z]+@[a-z]+\\.com"))
    SamplingParams(constraint=Constraint.grammar('root ::= "yes" | "no"'))   # EBNF (GBNF)
    SamplingParams(constraint=Constraint.choice(["positive", "negative"]))

The server checks and compiles the constraint before it queues the request: a malformed one, or
one that does not compile (an invalid schema, a regex or grammar with a syntax error, one that
can match nothing), raises ``GenerationError`` (INVALID_ARGUMENT) naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from draftwise_client._proto import generation_pb2 as pb

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint; build it with the class methods. ``value`` is the schema
    (JSON text), the regex or grammar text, the choices (a tuple), or "" for json_object."""

    kind: ConstraintKind
    value: str | tuple[str, ...] = ""

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any] | bool) -> Constraint:
        """A JSON Schema (a dict, or its JSON text): the output is one JSON value that validates.
        A pydantic model's ``model_json_schema()`` works."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The whole output matches ``pattern``."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        """An EBNF grammar (llama.cpp's GBNF dialect; the start rule is ``root``)."""
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """The output is exactly one of ``options``."""
        if isinstance(options, str):
            raise ValueError("choice takes a list of strings, not one string")
        return cls("choice", tuple(options))

    def fill(self, msg: pb.SamplingParams) -> None:
        """Set the ``constraint`` oneof of ``msg``."""
        if self.kind == "json_object":
            msg.json_object = True
        elif self.kind == "choice":
            msg.choice.options.extend(self.value)
        elif self.kind in ("json_schema", "regex", "grammar") and isinstance(self.value, str):
            setattr(msg, self.kind, self.value)
        else:
            raise ValueError(f"not a constraint: kind {self.kind!r} with value {self.value!r:.60}")


__all__ = ["Constraint", "ConstraintKind"]
