"""Command-line flags made from configuration dataclasses: one :class:`Flag` per field, its
name, default and help taken from the field, so that no parser repeats them.

A config dataclass documents every field where it is declared, either with a string right
under it (``GatewayConfig``) or with a comment at its end (``EngineConfig``); :func:`field_docs`
reads both from the class's source. :func:`table` turns the fields into flags: the option is
``--`` + the field's name with ``-`` for ``_`` (vLLM's names, where vLLM has one), unless
renamed; the type follows the annotation (``int``, ``float``, ``str``/``Path``, each optionally
``| None``; ``bool`` is a switch, ``--x``/``--no-x``; ``tuple[str, ...]`` a repeatable flag), and
a field whose type is none of these needs a converter or must be listed as internal (with why).
:func:`add_flags` adds a table to an argparse parser (with ``dest`` = the field's name), and
:func:`config_values` reads the parsed values back as the dataclass's keyword arguments.

Users arriving from vLLM's guides type some flags under other names: :data:`SYNONYMS` gives a
field's flag more options (``--draft-model`` for ``--speculative-model``) in every table with that
field, and :data:`NO_EFFECT` lists flags accepted beside a field's flag that change nothing here
(``--use-v2-block-manager``), each printing a one-line notice on stderr when given.

Torch-free and worker-free: the gateway builds its parser from this module too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Convert = Callable[[str], Any]

_SCALARS: dict[str, Convert] = {"int": int, "float": float, "str": str, "Path": str, "str | Path": str}

SYNONYMS: dict[str, tuple[str, ...]] = {"speculative_model": ("--draft-model",)}
"""{field: more options for its flag}, in every table with a field of that name: the names vLLM's
guides use where they differ from the field's."""
NO_EFFECT: dict[str, tuple[tuple[str, str], ...]] = {
    "block_size": (
        (
            "--use-v2-block-manager",
            "notice: --use-v2-block-manager changes nothing: draftwise has one block manager (paged KV blocks, the "
            "only one), always on",
        ),
    ),
}
"""{field: ((option, notice), ...)}: switches added beside the field's flag (vLLM's, from its guides)
that change nothing here; given, they print their notice on stderr (their value is read by no config)."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag standing for one field of a config dataclass."""

    name: str
    """The field's name, also the flag's argparse ``dest``."""
    option: str
    """The flag: ``--max-num-seqs``."""
    default: Any
    """The field's default."""
    help: str
    """The field's doc, as one line (field names written as flags)."""
    convert: Convert | None
    """Text to value; None: a switch (``--x`` / ``--no-x``)."""
    repeatable: bool = False
    """A list given by repeating the flag (``--worker A --worker B``); the field holds a tuple."""
    aliases: tuple[str, ...] = ()
    """More options for the same flag (:data:`SYNONYMS`)."""
    no_effect: tuple[tuple[str, str], ...] = ()
    """(option, notice) of flags accepted beside this one that change nothing (:data:`NO_EFFECT`)."""

    @property
    def is_switch(self) -> bool:
        return self.convert is None


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its doc} of a dataclass, from its source: the string literal right under
    the field, or else the comment(s) on the field's own lines. Whitespace collapsed."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    body = node.body
    docs: dict[str, str] = {}
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            text = after.value.value
        else:
            end = stmt.end_lineno or stmt.lineno
            text = " ".join(comments[n] for n in range(stmt.lineno, end + 1) if n in comments)
        if text.strip():
            docs[stmt.target.id] = " ".join(text.split())
    return docs


def option_for(name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def _kind(name: str, annotation: object) -> tuple[Convert | None, bool]:
    """(converter, repeatable) for a field's annotation; TypeError for one no flag can hold."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    base = re.sub(r"\s*\|\s*None$", "", text.strip())
    if base == "bool":
        return None, False
    if base in _SCALARS:
        return _SCALARS[base], False
    if base == "tuple[str, ...]":
        return str, True
    raise TypeError(f"field {name!r} ({text}) has no flag type: give it a converter or list it as internal")


def _one_line(doc: str, options: Mapping[str, str]) -> str:
    """The first sentence of ``doc``, field names written as their flags, ready for argparse."""
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z(])", doc, maxsplit=1)[0].rstrip(".")
    first = first.replace("``", "").replace("`", "")
    first = re.sub(r"\bNone\b", "unset", first)
    first = re.sub(r"\bFalse\b", "off", re.sub(r"\bTrue\b", "on", first))
    for name in sorted(options, key=len, reverse=True):
        if "_" in name:  # one-word names ("model", "port") are also plain words
            first = re.sub(rf"(?<![\w.-]){name}\b", options[name], first)
    words = first.split(maxsplit=2)
    lead = words[0] if words else ""
    if (lead[1:].islower() or lead == "A") and not (len(words) > 1 and words[1][:1].isupper()):
        first = first[0].lower() + first[1:]  # "Address to listen on": "address ..."; "PEM", "Hugging Face" stay
    return first.replace("%", "%%")


def table(
    cls: type,
    *,
    internal: Mapping[str, str] | None = None,
    options: Mapping[str, str] | None = None,
    converters: Mapping[str, Convert] | None = None,
) -> tuple[Flag, ...]:
    """A flag for every field of the dataclass ``cls`` but those in ``internal`` ({field: why it
    has no flag}). ``options``: {field: flag} where the flag is not the field's name;
    ``converters``: {field: text-to-value} where the annotation's own type will not do.
    ValueError for a field without a doc or a name in a mapping that is not a field."""
    internal, renamed, converters = internal or {}, options or {}, converters or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = (set(internal) | set(renamed) | set(converters)) - set(fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    docs = field_docs(cls)
    flagged = [name for name in fields if name not in internal]
    opts = {name: renamed.get(name, option_for(name)) for name in flagged}
    out = []
    for name in flagged:
        f = fields[name]
        if name not in docs:
            raise ValueError(f"{cls.__name__}.{name} has no doc (a string under it or a comment at its end)")
        convert, repeatable = _kind(name, f.type)
        if name in converters:
            convert = converters[name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise ValueError(f"{cls.__name__}.{name} has no default")
        help_ = _one_line(docs[name], opts)
        out.append(
            Flag(name, opts[name], default, help_, convert, repeatable, SYNONYMS.get(name, ()), NO_EFFECT.get(name, ()))
        )
    return tuple(out)


class _Notice(argparse._StoreTrueAction):
    """A switch that changes nothing: given on the command line, it prints its notice on stderr. Its
    value (``dest``: the option's name) is read by no configuration; a switch like any other, it
    also reads its ``DRAFTWISE_<FLAG>`` variable (:mod:`draftwise.envflags`), silently."""

    def __init__(self, option_strings: Sequence[str], dest: str, notice: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.notice = notice

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(self.notice, file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _shown(value: object) -> str:
    return str(value).replace("%", "%%")


def add_flags(
    parser: argparse._ActionsContainer,
    flags: Sequence[Flag],
    *,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Add ``flags`` (but those named in ``skip``) to ``parser``. ``defaults``: {field: value}
    where this parser's default is not the field's; ``helps``: {field: help} where this parser
    says more than the field's doc."""
    defaults, helps = defaults or {}, helps or {}
    for flag in flags:
        if flag.name in skip:
            continue
        default = defaults.get(flag.name, flag.default)
        text = helps.get(flag.name, flag.help)
        metavar = flag.option[2:].upper().replace("-", "_")
        options = (flag.option, *flag.aliases)
        for option, notice in flag.no_effect:
            parser.add_argument(
                option, action=_Notice, notice=notice, help=notice.partition(": ")[2].replace("%", "%%")
            )
        convert = flag.convert
        if convert is None:  # a switch
            text = f"{text} (default: {'on' if default else 'off'})"
            parser.add_argument(
                *options, dest=flag.name, action=argparse.BooleanOptionalAction, default=default, help=text
            )
            continue
        if default is not None and default != ():
            text = f"{text} (default: {_shown(default)})"
        if flag.repeatable:
            parser.add_argument(
                *options,
                dest=flag.name,
                action="append",
                type=convert,
                default=list(default or ()),
                metavar=metavar,
                help=text,
            )
        else:
            parser.add_argument(*options, dest=flag.name, type=convert, default=default, metavar=metavar, help=text)


def config_values(args: argparse.Namespace, flags: Sequence[Flag], skip: Collection[str] = ()) -> dict[str, Any]:
    """{field: value} of ``flags`` (but ``skip``) as parsed into ``args``: the dataclass's
    keyword arguments (a repeatable flag's list as a tuple)."""
    out: dict[str, Any] = {}
    for flag in flags:
        if flag.name in skip:
            continue
        value = getattr(args, flag.name)
        out[flag.name] = tuple(value) if flag.repeatable else value
    return out


def changed(values: Mapping[str, Any], flags: Sequence[Flag]) -> dict[str, Any]:
    """The entries of ``values`` that differ from their flag's (the field's) default."""
    by_name = {f.name: f for f in flags}
    return {k: v for k, v in values.items() if k in by_name and v != by_name[k].default}


def as_argv(values: Mapping[str, Any], flags: Sequence[Flag]) -> list[str]:
    """``values`` ({field: value}) written as command-line flags of ``flags``, in table order:
    what another process's parser built from the same table reads back as these values."""
    out: list[str] = []
    for flag in flags:
        if flag.name not in values:
            continue
        value = values[flag.name]
        if flag.is_switch:
            out.append(flag.option if value else "--no-" + flag.option[2:])
        elif flag.repeatable:
            for item in value:
                out += [flag.option, str(item)]
        elif value is not None:
            out += [flag.option, str(value)]
    return out
