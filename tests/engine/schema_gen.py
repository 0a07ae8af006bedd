"""A seeded generator of JSON schemas for the structured-output suite (issue 27), and for each
schema a valid instance and invalid ones (for checking the generator against the grammar).

Every schema stays inside the subset the engine compiles (type, properties, required,
``additionalProperties: false``, items, enum, const, anyOf, minLength/maxLength,
minimum/maximum, minItems/maxItems, $defs/$ref) and bounds the length of its output: every
string has a maxLength (<= 8) or an enum, every array a maxItems (<= 3), every integer a small
range, every object ``additionalProperties: false``, and the longest compact instance is at most
``MAX_CHARS`` characters, so that even a small random model under the constraint usually ends
within ~120 tokens. Numbers other than integers appear only as enum/const values (a free
``number`` has unbounded digits).

    schemas = generate_schemas(240, seed=0)
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

Schema = dict[str, Any]

MAX_DEPTH = 3
"""Objects nest at most this deep (the top-level object is depth 1)."""
MAX_CHARS = 150
"""Longest compact JSON text (", " and ": " separators) a generated schema allows."""

NAMES = (
    "id", "name", "age", "tags", "active", "kind", "value", "score", "city", "color",
    "count", "label", "ok", "note", "x", "y", "status", "type", "data", "level",
)  # fmt: skip
WORDS = ("red", "blue", "ok", "yes", "no", "cat", "dog", "a", "b", "on", "off", "high", "low")
SCALARS: tuple[Any, ...] = (0, 1, 2, 7, -1, 42, 2.5, -0.5, True, False, None, "a", "x", "hi", "on", "")
"""Values of mixed types for enums and consts (no two equal under JSON Schema's equality)."""


def _distinct(values: list[Any]) -> list[Any]:
    """``values`` without repeats, JSON Schema equality (True is not 1, 1.0 is 1)."""
    out: list[Any] = []
    for v in values:
        if not any(type(v) is type(w) and v == w for w in out) and not any(
            not isinstance(v, bool) and not isinstance(w, bool) and isinstance(v, int | float) and v == w for w in out
        ):
            out.append(v)
    return out


class SchemaGen:
    """Random schemas from one ``random.Random(seed)``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.defs: dict[str, Schema] = {}

    def schema(self) -> Schema:
        """One schema within ``MAX_CHARS`` (drawn again until it fits)."""
        while True:
            self.defs = {}
            r = self.rng.random()
            if r < 0.8:
                s = self.obj(1)
            elif r < 0.9:
                s = self.array(1)
            elif r < 0.95:
                s = self.any_of(1)
            else:
                s = self.leaf()
            if self.defs:
                s["$defs"] = self.defs
            if max_chars(s) <= MAX_CHARS:
                return s

    def node(self, depth: int) -> Schema:
        """A property's or an item's schema at ``depth``."""
        r = self.rng.random()
        if depth < MAX_DEPTH and r < 0.15:
            return self.obj(depth + 1)
        if depth < MAX_DEPTH and r < 0.25:
            return self.array(depth)
        if r < 0.33:
            return self.any_of(depth)
        if r < 0.38:
            return self.ref()
        return self.leaf()

    def leaf(self) -> Schema:
        rng = self.rng
        kind = rng.choice(["string", "string", "string_enum", "integer", "integer", "boolean", "null", "enum", "const"])
        if kind == "string":
            s: Schema = {"type": "string", "maxLength": rng.randint(1, 8)}
            if rng.random() < 0.3:
                s["minLength"] = rng.randint(0, min(2, s["maxLength"]))
            return s
        if kind == "string_enum":
            words = rng.sample(WORDS, rng.randint(2, 4))
            return {"type": "string", "enum": words} if rng.random() < 0.5 else {"enum": words}
        if kind == "integer":
            lo = rng.randint(-20, 50)
            s = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 80)}
            if rng.random() < 0.15:
                del s["minimum" if rng.random() < 0.5 else "maximum"]
                s.setdefault("minimum", -99)
                s.setdefault("maximum", 999)
            return s
        if kind in ("boolean", "null"):
            return {"type": kind}
        if kind == "enum":
            return {"enum": _distinct(rng.sample(SCALARS, rng.randint(2, 5)))}
        return {"const": rng.choice(SCALARS + tuple(WORDS))}

    def obj(self, depth: int) -> Schema:
        rng = self.rng
        n = rng.randint(1, 4 if depth == 1 else 3 if depth == 2 else 2)
        names = rng.sample(NAMES, n)
        props = {name: self.node(depth) for name in names}
        required = [name for name in names if rng.random() < 0.6]
        s: Schema = {"type": "object", "properties": props}
        if required:
            s["required"] = required
        s["additionalProperties"] = False
        return s

    def array(self, depth: int) -> Schema:
        rng = self.rng
        hi = rng.randint(1, 3)
        s: Schema = {"type": "array", "items": self.node(depth), "maxItems": hi}
        if rng.random() < 0.4:
            s["minItems"] = rng.randint(0, min(1, hi))
        return s

    def any_of(self, depth: int) -> Schema:
        rng = self.rng
        branches = [self.leaf(), self.obj(depth + 1) if depth < MAX_DEPTH and rng.random() < 0.3 else self.leaf()]
        rng.shuffle(branches)
        return {"anyOf": branches}

    def ref(self) -> Schema:
        """A $ref to a (new or earlier) definition of a small object or a leaf."""
        if self.defs and self.rng.random() < 0.5:
            return {"$ref": f"#/$defs/{self.rng.choice(sorted(self.defs))}"}
        name = f"d{len(self.defs)}"
        if self.rng.random() < 0.5:
            self.defs[name] = self.leaf()
        else:  # a small object of leaves (a definition refers to nothing: no cycles)
            names = self.rng.sample(NAMES, self.rng.randint(1, 3))
            props = {k: self.leaf() for k in names}
            self.defs[name] = {
                "type": "object",
                "properties": props,
                "required": names[:1],
                "additionalProperties": False,
            }
        return {"$ref": f"#/$defs/{name}"}


def generate_schemas(n: int = 240, seed: int = 0) -> list[Schema]:
    """``n`` distinct schemas from ``seed`` (the same list every time)."""
    gen = SchemaGen(seed)
    out: list[Schema] = []
    seen: set[str] = set()
    while len(out) < n:
        s = gen.schema()
        key = json.dumps(s, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _resolve(s: Schema, root: Schema) -> Schema:
    while "$ref" in s:
        s = root["$defs"][s["$ref"].rsplit("/", 1)[1]]
    return s


def max_chars(schema: Schema, root: Schema | None = None) -> int:
    """Length of the longest compact JSON text (", " / ": " separators) that ``schema`` allows."""
    root = root if root is not None else schema
    s = _resolve(schema, root)
    if "const" in s:
        return len(json.dumps(s["const"]))
    if "enum" in s:
        return max(len(json.dumps(v)) for v in s["enum"])
    if "anyOf" in s:
        return max(max_chars(b, root) for b in s["anyOf"])
    t = s["type"]
    if t == "string":
        return s["maxLength"] + 2
    if t == "integer":
        return max(len(str(s["minimum"])), len(str(s["maximum"])))
    if t in ("boolean", "null"):
        return 5
    if t == "array":
        return 2 + s["maxItems"] * (max_chars(s["items"], root) + 2)
    props = s["properties"]
    return 2 + sum(len(json.dumps(k)) + 2 + max_chars(v, root) + 2 for k, v in props.items())


def example(schema: Schema, rng: random.Random, root: Schema | None = None) -> Any:
    """A random instance of ``schema`` (valid by construction; strings of ASCII letters)."""
    root = root if root is not None else schema
    s = _resolve(schema, root)
    if "const" in s:
        return copy.deepcopy(s["const"])
    if "enum" in s:
        return copy.deepcopy(rng.choice(s["enum"]))
    if "anyOf" in s:
        return example(rng.choice(s["anyOf"]), rng, root)
    t = s["type"]
    if t == "string":
        k = rng.randint(s.get("minLength", 0), s["maxLength"])
        return "".join(rng.choice("abcxyzQ ") for _ in range(k))
    if t == "integer":
        return rng.randint(s["minimum"], s["maximum"])
    if t == "boolean":
        return rng.random() < 0.5
    if t == "null":
        return None
    if t == "array":
        return [example(s["items"], rng, root) for _ in range(rng.randint(s.get("minItems", 0), s["maxItems"]))]
    req = set(s.get("required", ()))
    return {k: example(v, rng, root) for k, v in s["properties"].items() if k in req or rng.random() < 0.5}


def invalid_examples(schema: Schema, rng: random.Random) -> list[Any]:
    """Instances that break ``schema`` in one place each: a string one too long, an integer out
    of range, a required property missing, a property not listed, one item too many, a value
    of the wrong type. JSON Schema rejects every one (the caller checks)."""
    out: list[Any] = []

    def walk(s: Schema, inst: Any, put) -> None:
        s = _resolve(s, schema)
        if "anyOf" in s or "enum" in s or "const" in s:
            return
        t = s["type"]
        if t == "string" and isinstance(inst, str):
            put("q" * (s["maxLength"] + 1))
        elif t == "integer" and isinstance(inst, int):
            put(s["maximum"] + 1)
            put(s["minimum"] - 1)
        elif t == "array" and isinstance(inst, list):
            put(inst + [example(s["items"], rng, schema)] * (s["maxItems"] + 1 - len(inst)))
            for i, item in enumerate(inst):
                walk(s["items"], item, lambda v, i=i: put(inst[:i] + [v] + inst[i + 1 :]))
        elif t == "object" and isinstance(inst, dict):
            put({**inst, "zz_extra": 1})
            for k in s.get("required", ()):
                put({key: v for key, v in inst.items() if key != k})
            for k, v in inst.items():
                walk(s["properties"][k], v, lambda new, k=k: put({**inst, k: new}))
        if t != "null":
            put(None)
        else:
            put(0)

    walk(schema, example(schema, rng), out.append)
    return out


def summary(schemas: list[Schema]) -> dict[str, int]:
    """How many schemas use each keyword (for checking variety)."""
    counts: dict[str, int] = {}

    def visit(x: Any, seen: set[str]) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("properties", "$defs"):
                    seen.add(k)
                    for sub in v.values():
                        visit(sub, seen)
                    continue
                seen.add(k if k != "type" else f"type:{v}")
                if k in ("enum", "const") and isinstance(v, list | dict):
                    continue
                visit(v, seen)
        elif isinstance(x, list):
            for v in x:
                visit(v, seen)

    for s in schemas:
        seen: set[str] = set()
        visit(s, seen)
        for k in seen:
            counts[k] = counts.get(k, 0) + 1
    return counts


__all__ = [
    "MAX_CHARS",
    "MAX_DEPTH",
    "SchemaGen",
    "example",
    "generate_schemas",
    "invalid_examples",
    "max_chars",
    "summary",
]
