"""Structured output over OpenAI's HTTP: what a request body asks its output to match, as one
constraint of the contract's ``SamplingParams.constraint`` oneof.

The fields, as OpenAI and vLLM name them:

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (one JSON
  value matching ``schema``; enforced whatever ``strict`` says, as vLLM does);
- vLLM's ``extra_body`` keys: ``guided_json`` (a schema, as an object or JSON text),
  ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (EBNF), and the newer
  ``structured_outputs`` object with one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``.

At most one constraint per request. Only the shape is checked here (types, sizes, a schema that is
a JSON object); whether it compiles against the model's vocabulary is the worker's check, which
refuses a request whose constraint does not compile with INVALID_ARGUMENT (HTTP 400) before it is
queued. Plain functions over dicts: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from draftwise.gateway.openai.api_error import ApiError, show

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]

MAX_CONSTRAINT_BYTES = 256 * 1024
"""Largest schema, regex or grammar text (UTF-8 bytes), and largest choice list in total (the worker's limit)."""
MAX_CHOICES = 1024
"""Most strings a choice constraint may list (the worker's limit)."""

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older ``extra_body`` keys, one per constraint kind."""
IGNORED_OPTIONS = frozenset({"guided_decoding_backend"})
"""vLLM fields that pick how a constraint is enforced, not what it is: accepted, without effect."""
REFUSED_OPTIONS = {
    "guided_whitespace_pattern": "a whitespace pattern for JSON is not supported",
    "structural_tag": "structural tags are not supported",
}
"""vLLM fields that would change what the output may be: refused (ignoring them would not be what was asked)."""
_SO_KINDS: dict[str, Kind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
_SO_IGNORED = frozenset({"disable_fallback"})


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's output constraint: its ``kind``, its ``value`` (schema as JSON text, regex or
    grammar text, the choices; "" for json_object) and ``param``, the field it came from (named in
    errors)."""

    kind: Kind
    value: str | tuple[str, ...]
    param: str

    @property
    def schema(self) -> Any:
        """A json_schema constraint's schema, parsed."""
        assert self.kind == "json_schema" and isinstance(self.value, str)
        return json.loads(self.value)


def constraint_from_body(body: dict[str, Any]) -> ConstraintSpec | None:
    """The constraint ``body`` asks for (None: none); ApiError(400) naming the field that is wrong,
    or the second field when two ask for a constraint."""
    for name, why in REFUSED_OPTIONS.items():
        if body.get(name) not in (None, "", [], {}):
            raise ApiError(400, f"{name}: {why} by this server", name)
    found: list[ConstraintSpec] = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(fmt)
    for name in GUIDED:
        v = body.get(name)
        if v is not None:
            found.append(_guided(name, v))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(_structured_outputs(so))
    return one_constraint(found)


def one_constraint(found: list[ConstraintSpec]) -> ConstraintSpec | None:
    """The only constraint in ``found``, or None; ApiError(400) naming the second when there are more."""
    if len(found) > 1:
        a, b = found[0].param, found[1].param
        raise ApiError(
            400, f"{b}: a request takes at most one output constraint, and {a} already sets one", b.split(".")[0]
        )
    return found[0] if found else None


def _response_format(fmt: object) -> ConstraintSpec | None:
    if fmt is None:
        return None
    where = "response_format"
    if not isinstance(fmt, dict):
        raise ApiError(400, f"{where} must be an object such as {{'type': 'json_object'}}, got {show(fmt)}", where)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", "", where)
    if kind != "json_schema":
        raise ApiError(
            400, f"{where}.type must be 'text', 'json_object' or 'json_schema', got {show(kind)}", f"{where}.type"
        )
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError(
            400,
            f"{where}.json_schema must be an object {{'name', 'schema', 'strict'}} when type is 'json_schema', "
            f"got {show(js)}",
            f"{where}.json_schema",
        )
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, f"{where}.json_schema.name must be a string, got {show(name)}", f"{where}.json_schema.name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(
            400, f"{where}.json_schema.strict must be true or false, got {show(strict)}", f"{where}.json_schema.strict"
        )
    if "schema" not in js or js["schema"] is None:
        raise ApiError(
            400, f"{where}.json_schema.schema is missing: give the JSON schema", f"{where}.json_schema.schema"
        )
    return schema_constraint(js["schema"], f"{where}.json_schema.schema")


def schema_constraint(schema: object, where: str, text_ok: bool = False) -> ConstraintSpec:
    """A json_schema constraint of ``schema`` (a JSON object; with ``text_ok`` also JSON text of one)."""
    if text_ok and isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(400, f"{where} is not valid JSON: {str(e)[:120]}", where) from None
        except RecursionError:
            raise ApiError(400, f"{where} is nested too deeply to parse", where) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{where} must be a JSON schema (a JSON object), got {show(schema)}", where)
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as e:  # NaN or Infinity in the schema: not JSON a worker can read back
        raise ApiError(400, f"{where} is not valid JSON: {e}", where) from None
    except RecursionError:
        raise ApiError(400, f"{where} is nested too deeply", where) from None
    _check_size(text, where)
    return ConstraintSpec("json_schema", text, where)


def _check_size(text: str, where: str) -> None:
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise ApiError(400, f"{where} is larger than {MAX_CONSTRAINT_BYTES} bytes", where)


def _text(kind: Kind, v: object, where: str) -> ConstraintSpec:
    if not isinstance(v, str) or not v.strip():
        raise ApiError(400, f"{where} must be a non-empty string ({kind}), got {show(v)}", where)
    _check_size(v, where)
    return ConstraintSpec(kind, v, where)


def _choices(v: object, where: str) -> ConstraintSpec:
    if not isinstance(v, list) or not v:
        raise ApiError(400, f"{where} must be a non-empty list of strings, got {show(v)}", where)
    if len(v) > MAX_CHOICES:
        raise ApiError(400, f"{where} lists {len(v)} strings; at most {MAX_CHOICES}", where)
    for i, s in enumerate(v):
        if not isinstance(s, str) or not s:
            raise ApiError(400, f"{where}[{i}] must be a non-empty string, got {show(s)}", f"{where}[{i}]")
    if sum(len(s.encode()) for s in v) > MAX_CONSTRAINT_BYTES:
        raise ApiError(400, f"{where} is larger than {MAX_CONSTRAINT_BYTES} bytes in total", where)
    return ConstraintSpec("choice", tuple(v), where)


def _guided(name: str, v: object) -> ConstraintSpec:
    if name == "guided_json":
        return schema_constraint(v, name, text_ok=True)
    if name == "guided_choice":
        return _choices(v, name)
    return _text("regex" if name == "guided_regex" else "grammar", v, name)


def _structured_outputs(so: object) -> ConstraintSpec:
    where = "structured_outputs"
    if not isinstance(so, dict):
        raise ApiError(400, f"{where} must be an object such as {{'json': <schema>}}, got {show(so)}", where)
    found: list[ConstraintSpec] = []
    for key, v in so.items():
        param = f"{where}.{key}"
        if key in _SO_IGNORED or v is None:
            continue
        if key not in _SO_KINDS:
            allowed = ", ".join(_SO_KINDS)
            raise ApiError(400, f"{param} is not supported by this server (it takes one of {allowed})", param)
        kind = _SO_KINDS[key]
        if kind == "json_schema":
            found.append(schema_constraint(v, param, text_ok=True))
        elif kind == "choice":
            found.append(_choices(v, param))
        elif kind == "json_object":
            if not isinstance(v, bool):
                raise ApiError(400, f"{param} must be true or false, got {show(v)}", param)
            if v:
                found.append(ConstraintSpec("json_object", "", param))
        else:
            found.append(_text(kind, v, param))
    if len(found) > 1:
        raise ApiError(
            400, f"{where} sets {found[0].param} and {found[1].param}: at most one constraint", found[1].param
        )
    if not found:
        raise ApiError(400, f"{where} sets no constraint: give one of {', '.join(_SO_KINDS)}", where)
    return found[0]
