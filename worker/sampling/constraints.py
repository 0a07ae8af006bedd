"""What a constrained request's output must match: a JSON schema, any JSON object, a regular
expression, an EBNF grammar, or one of a few strings (``SamplingParams.constraint``).

A :class:`Constraint` is only the description, checked for its shape here (the right type, a
bounded size, a schema that is JSON). Whether it compiles against the model's vocabulary is the
engine's check (``draftwise.worker.sampling.grammar``), made before the request is queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")

MAX_CONSTRAINT_BYTES = 256 * 1024
"""Largest schema, regex or grammar text (UTF-8 bytes), and largest choice list in total."""
MAX_CHOICES = 1024
"""Most strings a choice constraint may list."""


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint. Build it with the class methods; ``value`` is the schema
    (canonical JSON text), regex or grammar text, the choices (a tuple), or "" for json_object."""

    kind: ConstraintKind
    value: str | tuple[str, ...] = ""

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any]) -> Constraint:
        """A JSON Schema, as JSON text or a dict; the output is one JSON value that validates."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The whole output matches ``pattern`` (anchored at both ends)."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        """An EBNF grammar (the GBNF dialect of llama.cpp, as xgrammar reads it; the start rule is ``root``)."""
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """The output is exactly one of ``options``."""
        return cls("choice", tuple(options) if not isinstance(options, str) else (options,))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            self._check_choices()
        elif self.kind == "json_object":
            if self.value != "":
                raise ValueError("a json_object constraint takes no value")
        else:
            self._check_text()

    def _check_text(self) -> None:
        v = self.value
        if not isinstance(v, str):
            raise ValueError(f"a {self.kind} constraint must be a string, got {type(v).__name__}")
        if not v.strip():
            raise ValueError(f"the {self.kind} constraint is empty")
        if len(v.encode()) > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"the {self.kind} constraint is larger than {MAX_CONSTRAINT_BYTES} bytes")
        if self.kind == "json_schema":
            try:
                schema = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"the json_schema constraint is not valid JSON ({e})") from None
            except RecursionError:
                raise ValueError("the json_schema constraint is nested too deeply") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    f"the json_schema constraint must be an object or a boolean, got {type(schema).__name__}"
                )
            object.__setattr__(
                self, "value", json.dumps(schema, separators=(",", ":"))
            )  # key order kept: it is the output order

    def _check_choices(self) -> None:
        v = self.value
        if not isinstance(v, tuple) or not v:
            raise ValueError("a choice constraint needs at least one string")
        if len(v) > MAX_CHOICES:
            raise ValueError(f"a choice constraint may list at most {MAX_CHOICES} strings, got {len(v)}")
        for s in v:
            if not isinstance(s, str) or not s:
                raise ValueError(f"a choice constraint's options must be non-empty strings, got {s!r:.60}")
        if sum(len(s.encode()) for s in v) > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"the choices are larger than {MAX_CONSTRAINT_BYTES} bytes in total")

    @property
    def schema(self) -> Any:
        """The JSON schema of a json_schema constraint, parsed."""
        assert self.kind == "json_schema" and isinstance(self.value, str)
        return json.loads(self.value)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": list(self.value) if isinstance(self.value, tuple) else self.value}

    @classmethod
    def from_any(cls, data: Constraint | Mapping[str, Any]) -> Constraint:
        """A Constraint, or its :meth:`to_dict` form."""
        if isinstance(data, Constraint):
            return data
        if not isinstance(data, Mapping) or set(data) - {"kind", "value"} or "kind" not in data:
            raise ValueError(f"constraint must be a Constraint or a dict with 'kind' and 'value', got {data!r:.60}")
        value = data.get("value", "")
        return cls(data["kind"], tuple(value) if isinstance(value, list) else value)


__all__ = ["KINDS", "MAX_CHOICES", "MAX_CONSTRAINT_BYTES", "Constraint", "ConstraintKind"]
